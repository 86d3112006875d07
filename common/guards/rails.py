"""The guard rails of a run, attached to the lesson where they act. A stage hands its main() to run(), which
makes one Guard and passes it in; every line of the stage that uses it names what it guards, and a learner
may skip each of them: the training reads the same without. What each one holds off is in tests/FAILURES.md.

  start()         before setup(): one run per output folder, a launch that can work, and a watch on the
                  rendezvous setup() makes, bounded and naming who did not come
  agree()         before the first step: every rank trains the same run on the same data
  resume()        whether this run may continue the checkpoint the lesson chose (or start afresh in its
                  folder); signals are caught from here
  end_of_step()   a diverged loss stops the run; a stop or --checkpoint-minutes saves here and, during an
                  evaluation, at end_of_batch()
  check_epoch()   nothing non-finite is ever saved
  check_folder()  the export writes in the run's own folder (export.save_model())
  run(main)       any failure ends the run with one line instead of a traceback
"""

import functools
import threading
import time
import warnings

import torch
import torch.distributed as dist

from common import cli, distributed
from common.environment import is_rank0
from common.guards import (
    arrival,
    check,
    divergence,
    early,
    failure,
    identity,
    launching,
    lock,
    logits,
    ownership,
    preflight,
    pretrained,
    randomness,
    recorded,
    rendezvous,
    resume,
    samples,
    signals,
    sources,
)
from common.guards.ending import Refusal, end
from common.guards.progress import Progress
from common.guards.saving import Saving
from common.guards.waits import within
from common.guards.watchdog import Watchdog

RULED = 10  # seconds a rank that ends with rank 0's line waits for rank 0 to reach it (ruled())


class Guard:
    """The guard rails of one run, in parts with one job each: `progress`, where the run stands (progress.py);
    `saving`, the agreement on where to stop and save (saving.py), from resume() on; `watchdog`, the bounded waits
    and heartbeats of a process group (watchdog.py), from meet() on. Each method below is where a stage calls it."""

    def __init__(self):
        self.args, self.lock, self.watchdog, self.saving, self.progress = None, None, None, None, Progress()
        self.hold = None  # the folder rank 0 took and its lock, by identity (identity.py)
        self.claimed = False  # the folder is this run's (resume()): a failure keeps its traceback there
        self.data, self.sizes = None, None  # the training and test sets' fingerprints, the sets' sizes
        self.default_loss = False  # the task has no loss() of its own: cross-entropy on the model's output
        self.own_loss, self.probe = None, None  # the task's loss(); drawing two training samples: check_mean(), why()

    @property
    def doing(self):
        """A stage 05 checkpoint read or written, for a failure's one line (failure.explain()), or None."""
        return self.saving and self.saving.doing

    def start(self, args):
        """Claim --output-dir, check the launch, and watch the rendezvous distributed.setup() makes next."""
        self.args = args
        check.check_environment()  # every launcher variable, before anything reads it
        check.check_args(args, gpus=0 if args.no_cuda else torch.cuda.device_count())
        self.lock = lock.claim(args.output_dir)  # first: one run per folder, and a folder it can write
        self.hold = identity.held(args.output_dir, self.lock)  # the folder itself, whatever its path names later
        randomness.seed(args.seed)  # numpy's and random's, as the stage seeds torch's
        self.meet(args)

    def meet(self, args):
        """start() but the output folder: check the launch, and watch the rendezvous setup() makes next, from
        outside it (the doctor's start too)."""
        check.check_environment()
        launch = distributed.launcher()
        launching.check_launch(launch, args)  # numbers that fit together, before anyone waits for anyone
        launching.check_device(args, launch.local_rank)
        if not launch.addr:
            return
        launching.check_interfaces("nccl" if torch.cuda.is_available() and not args.no_cuda else "gloo")
        rendezvous.check_rendezvous(launch, args.dist_timeout)  # an address that resolves, a port free or answering
        self.watchdog = Watchdog(launch, args.dist_timeout)
        self.watchdog.watch()  # a second client of setup()'s store: who did not come; then who went silent

    def agree(self, train_set, val_set, test_set, task):
        """Every rank trains the same run on the same data; the run's manifest records what it is trained on, and
        the task by the bytes that were loaded (cli.load_task() keeps them), not by its file read again."""
        own = sources.with_own_modules(task)
        self.args.task = preflight.Task.loaded(self.args.task, own, scheduled=hasattr(task, "scheduler"))
        preflight.agree(self.args, task, train_set, test_set)  # first: it says in one line what a task's data lacks
        self.sizes = (len(train_set), len(val_set), len(test_set))  # what each epoch must count: check_epoch()
        self.default_loss = not hasattr(task, "loss")
        # drawn where they are used (a task's loss() at the start, a failure): each sample is read once an epoch
        self.own_loss, self.probe = getattr(task, "loss", None), functools.partial(samples.first_batch, train_set, task)
        samples.check_totals(self.args, task, self.sizes[1:])  # a task's totals: a row on every rank
        pretrained.check_weights(self.args, task)  # the task's file of whole weights, before it is trusted
        pretrained.check_meta_load(self.args, task)  # stage 05: weights model(args) loads itself are lost on meta
        self.data = {"data": preflight.fingerprint(train_set), "test": preflight.fingerprint(test_set)}

    def resume(self, path, states, sharded=False):
        """Before the lesson loads the checkpoint at `path` it chose (checkpoint.latest(); None: afresh): rank 0
        checks that it is this run's and whole, or that the folder is free for a fresh run, and every rank ends
        with its reason in one line where not. From here on SIGTERM and SIGUSR1 stop the run at a step all ranks
        agree on, and end_of_step() saves it. `states`: the lesson's, watched, for the saves on a stop, and with the
        random generators added, which every checkpoint holds from here."""
        launching.check_split(states["model"], sharded)  # DDP's or FSDP's, where several ranks were launched
        early.started()
        states["rng"] = randomness.Generators()  # a resumed run draws as the uninterrupted one would have
        identity.check_held(self.hold)  # the folder taken at start(), before its manifest is written
        if sharded and dist.is_initialized():
            preflight.check_shared(self.args.output_dir, self.lock)
        self.saving = Saving(self.args, states, sharded, self.watchdog, self.progress, self.hold)
        self.saving.catch()
        if self.default_loss and not self.args.compile:  # compiled, a hook would change the graphs
            logits.watch(states["model"], self.args.task)  # probabilities out (a softmax, a sigmoid): its first step
        if self.own_loss and not self.args.compile:  # compiled, two samples would compile another graph
            samples.check_mean(states["model"], self.own_loss, self.probe(), self.args.task)  # a sum over the batch
        record = recorded.record(self.args, states, self.data)  # what defines the run, for its manifest
        # what its checkpoint must hold: its parts, the model's dtypes and shapes, the steps of an epoch
        declared = recorded.declared(states, sharded, self.sizes and self.sizes[0], self.args)
        state = resume.state_to_resume(self.args, path, sharded, record, declared)
        self.saving.steps = declared["steps"]
        self.claimed = True
        states["run"] = recorded.Stamp(is_rank0() and ownership.read(self.args.output_dir))  # in each checkpoint
        resume.same_columns(state, states["log"].fields)  # the task's metric renamed since: its rows do not fit
        if state is not None and state["folder"]:  # a failure while every rank reads its shards names the folder
            self.saving.doing = f"read {state['folder']}"
        if state is not None and state["step"]:  # saved mid-epoch: the lesson trains the rest of it
            self.progress.resumed(state["epoch"], state["step"])
            # saved after the epoch's last step: its scheduler steps with none in this process, as it should
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before `optimizer")

    def end_of_step(self, epoch, batch, sums):
        """After training step `batch` (counted from 0 in this run's part of the epoch): every --log-interval
        steps, stop if the loss went non-finite on any rank; then a stop or --checkpoint-minutes saves here."""
        at = self.progress.stepped(epoch, batch, sums)
        self.saving.stepped(at)
        if batch % self.args.log_interval == 0:
            self.saving.check_loss(epoch, at.step - 1, sums, self.why)
        self.saving.stop_or_save(at)

    def end_of_batch(self):
        """After each batch of evaluate(), as after a step: a stop or --checkpoint-minutes saves the epoch's
        training, all of it (the resumed run evaluates the epoch again); they count on from its last step."""
        if at := self.progress.evaluated(self.saving.so_far):  # None before this run's first step: nothing to save
            self.saving.stop_or_save(at, evaluating=True)

    def check_epoch(self, epoch, sums):
        """Before the epoch's row and checkpoint: its all-reduced losses (metrics.Epoch) and the weights finite, and
        every sample counted; the checkpoint the epoch's replaces stays as the previous one."""
        self.saving.check_weights(f"epoch {epoch} left weights that are not finite")  # first: a divergence is named so
        divergence.check_epoch(epoch, sums, self.args.output_dir, self.why)
        samples.check_counts(epoch, sums, self.sizes, self.args.dry_run)
        self.saving.epoch_end(epoch)

    def why(self, value):
        """Why a loss is `value`, not finite, where the weights are (divergence.of_the_loss()); every rank asks: the
        model's forward on the two samples is collective (compiled, it would compile another graph: not run)."""
        overflows = not self.args.compile and samples.overflows(self.saving.states["model"], self.probe())
        return divergence.of_the_loss(self.default_loss, self.args.output_dir, value, overflows)

    def check_folder(self):
        """Before --save-model's export (every rank): the folder and its lock still those rank 0 took."""
        identity.check_held(self.hold)

    def close(self, together):
        """Stop the heartbeat; with `together`, rank 0 (which serves the store, past the process group's end)
        waits until every rank has left."""
        if self.watchdog:
            self.watchdog.leave(together)


def run(main):
    """main(guard), the last line of every stage: any way it ends, the run ends with one line that says what
    happened and what to do, instead of a traceback; nothing is lost that a checkpoint holds. An error in a
    thread ends it alike (failure.in_thread())."""
    guard, together = Guard(), True  # together: every rank ends here alike, and rank 0 waits for the others
    signals.stop_at_once()  # until guard.resume(): nothing saved yet, nothing to lose
    threading.excepthook = failure.in_thread(guard)
    err, code = signals.failure(lambda: (check.task_file(), main(guard))), 0  # the task file before the lesson
    if err is not None:
        while True:  # until hold() is done, a signal pending as main() failed is raised as it begins, once each:
            try:
                signals.hold()  # the verdict is being reached: a stop now (torchrun's, for a rank that failed) waits
                break
            except signals.Stopped as stop:  # the stop is why (a peer it stopped too broke the collective this
                err = stop  # rank was in: DDP's construction)
            except RuntimeError:  # torch's SIGCHLD handler: a DataLoader worker ended, which workers.lost() names
                continue
        code, together = verdict(err, guard)
        if guard.watchdog is None and guard.args is not None and not isinstance(err, signals.Stopped):
            code = told(err, code, guard)
    ruled(guard.watchdog and guard.watchdog.store, follows=together and code == 1)
    guard.close(together)
    end(code, joined=guard.watchdog is not None)


def ruled(store, follows):
    """Rank 0 notes in the store that it has reached its verdict; a rank that `follows` it (ends with rank 0's line,
    status 1) waits for that, at most RULED seconds: torchrun stops every rank as the first one ends, and rank 0,
    stopped before its verdict, named the stop, not the cause it was about to say. Each store call is bounded, and
    a store gone (rank 0 with it) ends the wait (waits.within())."""
    if store and is_rank0():
        within(1, lambda: store.set("ruled", ""))  # from its verdict on, a stop waits (signals.hold())
    end = time.monotonic() + RULED
    while store and follows and time.monotonic() < end and within(1, lambda: not store.check(["ruled"])):
        time.sleep(0.05)


def told(err, code, guard):
    """A rank that failed before it met the others: its line, told to them through the store (arrival.tell()), and
    said here too where its launch differs from theirs, a verdict rank 0 would say for all had all met it."""
    line = code if isinstance(code, str) else getattr(err, "line", None)
    alone = not isinstance(code, str)  # a verdict rank 0 says for all: this rank may have met it alone
    said = arrival.tell(distributed.launcher(), guard.args.dist_timeout, line, alone)
    return said or code


def verdict(err, guard):
    """(exit status or line, whether every rank ends alike) for what ended main()."""
    if isinstance(err, signals.Stopped):
        return signals.say(err), False
    if isinstance(err, signals.SavedStop):  # a stop every rank agreed on and saved for
        return err.code, True
    if isinstance(err, cli.UsageError):  # the parser's, or the task's check()
        return check.refuse(check.said(err)), True
    if isinstance(err, Refusal):  # a guard rail's: its line (said already for a usage error), or rank 0's verdict
        return (err.code if isinstance(err.code, int) else failure.exit_line(err.code)), True
    if isinstance(err, SystemExit):  # the end of a run (--check, the doctor's verdict), or the task's sys.exit()
        if failure.raised_by(err, guard.args and guard.args.task):  # a failure of this rank, even sys.exit(0)
            return failure.settle(err, guard), False
        return (err.code if isinstance(err.code, int | None) else failure.exit_line(err.code)), True
    code = failure.refusal(err)  # the lesson's refusal (every rank met it) is its line as it is; each kind
    if code is None:  # explain() knows becomes its line, any other the fallback's
        return failure.settle(err, guard), False
    return code, True
