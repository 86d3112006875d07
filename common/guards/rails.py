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
  run(main)       any failure ends the run with one line instead of a traceback
"""

import time
import warnings
from dataclasses import asdict
from typing import NamedTuple

import torch
import torch.distributed as dist

from common import checkpoint, cli, distributed, sharded
from common.environment import is_rank0
from common.guards import (
    check,
    divergence,
    early,
    failure,
    lock,
    ownership,
    preflight,
    randomness,
    resume,
    samples,
    signals,
)
from common.guards.ending import end
from common.guards.preemption import Preemption
from common.guards.watchdog import Watchdog
from common.metrics import Sums


class Position(NamedTuple):
    """Where the run stands: `step` steps into `epoch`, this rank's training sums there, and
    `count`, a step count that grows across epochs (evaluation batches counting on)."""

    epoch: int
    step: int
    sums: Sums
    count: int


class Cut(NamedTuple):
    """The lesson's metrics.Log as a checkpoint saved part-way through an epoch keeps it: its rows, and the
    epoch's time and each rank's training sums so far (common/options/resuming.py hands them back)."""

    log: object
    cut: dict

    def state_dict(self):
        return self.log.state_dict() | {"cut": self.cut}


class Guard:
    def __init__(self):
        self.args, self.lock, self.watchdog, self.preemption = None, None, None, None
        self.states, self.sharded, self.epoch_done = None, False, None
        self.doing, self.position = None, None  # a stage 05 checkpoint read or written: for a failure's one line
        self.claimed = False  # the folder is this run's (resume()): a failure keeps its traceback there
        # (epoch, steps) where this run started (resumed part-way: steps > 0), and where it last saved (a stop)
        self.start_at = self.saved_at = (0, 0)
        self.data, self.sizes = None, None  # the training set's fingerprint, the sets' sizes

    def start(self, args):
        """Claim --output-dir, check the launch, and watch the rendezvous distributed.setup() makes next."""
        self.args = args
        check.check_environment()  # every launcher variable, before anything reads it
        check.check_args(args, gpus=0 if args.no_cuda else torch.cuda.device_count())
        self.lock = lock.claim(args.output_dir)  # first: one run per folder, and a folder it can write
        randomness.seed(args.seed)  # numpy's and random's, as the stage seeds torch's
        self.meet(args)

    def meet(self, args):
        """start() but the output folder: check the launch, and watch the rendezvous setup() makes next, from
        outside it (the doctor's start too)."""
        check.check_environment()
        launch = distributed.launcher()
        preflight.check_launch(launch, args)  # numbers that fit together, before anyone waits for anyone
        preflight.check_device(args, launch.local_rank)
        if not launch.addr:
            return
        preflight.check_interfaces("nccl" if torch.cuda.is_available() and not args.no_cuda else "gloo")
        check.check_rendezvous(launch, args.dist_timeout)  # an address that resolves, a port free or answering
        self.watchdog = Watchdog(launch, args.dist_timeout)
        self.watchdog.watch()  # a second client of setup()'s store: who did not come; then who went silent

    def agree(self, train_set, val_set, test_set, task):
        """Every rank trains the same run on the same data; the run's manifest records what it is trained on."""
        preflight.agree(self.args, task, train_set, test_set)  # first: it says in one line what a task's data lacks
        self.sizes = (len(train_set), len(val_set), len(test_set))  # what each epoch must count: check_epoch()
        samples.check_weights(self.args, task)  # stage 05's file of whole weights, before it is trusted
        self.data = preflight.fingerprint(train_set)

    def resume(self, path, states, sharded=False):
        """Before the lesson loads the checkpoint at `path` it chose (checkpoint.latest(); None: afresh): rank 0
        checks that it is this run's and whole, or that the folder is free for a fresh run, and every rank ends
        with its reason in one line where not. From here on SIGTERM and SIGUSR1 stop the run at a step all ranks
        agree on, and end_of_step() saves it. `states`: the lesson's, watched, for the saves on a stop."""
        self.states, self.sharded = states, sharded
        early.started()
        if sharded and dist.is_initialized():
            preflight.check_shared(self.args.output_dir)
        self.preemption = Preemption(self.watchdog, self.args.dist_timeout)
        self.preemption.catch()
        if self.watchdog:  # a rank may hear of the stop from the store before its own signal arrives
            self.watchdog.listen(self.preemption.poll)
        parameters = sum(p.numel() for p in states["model"].parameters())  # a sharded one's: its global shape
        record = {"flags": preflight.defining(self.args), "data": self.data, "parameters": parameters}
        state = resume.state_to_resume(self.args, path, sharded, record)
        self.claimed = True
        resume.same_columns(state, states["log"].fields)  # the task's metric renamed since: its rows do not fit
        if state is not None and state["folder"]:  # a failure while every rank reads its shards names the folder
            self.doing = f"read {state['folder']}"
        if state is not None and state["step"]:  # saved mid-epoch: the lesson trains the rest of it
            self.start_at = (state["epoch"], state["step"])
            # saved after the epoch's last step: its scheduler steps with none in this process, as it should
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before `optimizer")

    def end_of_step(self, epoch, batch, sums):
        """After training step `batch` (counted from 0 in this run's part of the epoch): every --log-interval
        steps, stop if the loss went non-finite on any rank; then stop_or_save()."""
        args, (start_epoch, start_step) = self.args, self.start_at
        step = (start_step if epoch == start_epoch else 0) + batch + 1
        if self.epoch_done is not None:  # the time since check_epoch(): the epoch's checkpoint, an upper bound
            self.preemption.saved(time.monotonic() - self.epoch_done)
            self.epoch_done = None
        self.doing, count = None, epoch * 2**32 + step  # a step count that grows across epochs
        if self.watchdog:
            self.watchdog.saving.clear()  # the epoch's checkpoint is whole
        if batch % args.log_interval == 0:
            divergence.check_loss(epoch, step - 1, sums, args.output_dir)
        self.stop_or_save(epoch, step, sums, count)

    def end_of_batch(self):
        """After each batch of evaluate(), as after a step: a stop or --checkpoint-minutes saves the epoch's
        training, all of it (the resumed run evaluates the epoch again); they count on from its last step."""
        epoch, step = self.start_at
        if self.position is None and step:  # resumed with no step left: the training the checkpoint holds
            _, sums = self.states["log"].carried[epoch]
            self.position = Position(epoch, step, sums, epoch * 2**32 + step)
        if self.position:  # None before this run's first step (a test's evaluation): nothing to save
            at = self.position
            self.stop_or_save(at.epoch, at.step, at.sums, at.count + 1)

    def stop_or_save(self, epoch, step, sums, count):
        """`count` steps done (evaluation batches counting on): on a stop, save at the step all ranks agreed on and
        end the run; with --checkpoint-minutes, save when they have passed."""
        self.position = Position(epoch, step, sums, count)
        if self.preemption.check(count):
            self.save(epoch, step, sums)
            distributed.print0(f"saved at epoch {epoch}, step {step}: resume with --resume ({self.preemption.signal})")
            raise signals.SavedStop(self.preemption.exit_code())
        if self.args.checkpoint_minutes and self.preemption.due(self.args.checkpoint_minutes, count):
            self.save(epoch, step, sums)
            distributed.print0(f"saved at epoch {epoch}, step {step} (--checkpoint-minutes {self.args.checkpoint_minutes})")  # fmt: skip

    def save(self, epoch, step, sums):
        """A checkpoint `step` steps into `epoch`: the sums and time so far go with it (its "cut"),
        so that the resumed run's row in metrics.csv counts the whole epoch. One there already (a stop in the
        evaluation a resumed run runs again, a second --checkpoint-minutes in one evaluation) stands as it is:
        the same step, and writing it again would replace the checkpoint a resume needs while it is written."""
        if (epoch, step) in (self.start_at, self.saved_at):
            return
        started, log, mine = time.monotonic(), self.states["log"], sums.tensor()
        parts = [mine.clone() for _ in range(dist.get_world_size() if dist.is_initialized() else 1)]
        if dist.is_initialized():  # each rank's own sums (the epoch's part before a resume included): carried()
            dist.all_gather(parts, mine)
        total = asdict(Sums(*torch.stack(parts).sum(0).tolist()))
        ranks = [asdict(Sums(*part.tolist())) for part in parts]
        cut = {"epoch": epoch, "seconds": log.seconds(mine.device), "training": total, "ranks": ranks}
        self.check_weights(f"epoch {epoch} left weights that are")
        if not self.sharded:
            resume.keep_previous(self.args.output_dir)
        self.writing(f"epoch-{epoch}-step-{step}")
        states = self.states | {"log": Cut(log, cut)}  # the lesson's states as they are, the log with its cut
        (sharded.save if self.sharded else checkpoint.save)(self.args.output_dir, epoch, states, step)
        self.preemption.saved(time.monotonic() - started)
        self.saved_at = (epoch, step)

    def check_epoch(self, epoch, sums):
        """Before the epoch's row and checkpoint: its all-reduced losses (metrics.Epoch) and the weights finite, and
        every sample counted; the checkpoint the epoch's replaces stays as the previous one."""
        divergence.check_epoch(epoch, sums, self.args.output_dir)
        self.check_weights(f"epoch {epoch} left weights that are")
        samples.check_counts(epoch, sums, self.sizes, self.args.dry_run)
        if not self.sharded:
            resume.keep_previous(self.args.output_dir)
        self.writing(f"epoch-{epoch}")
        self.epoch_done = time.monotonic()

    def writing(self, name):
        """Before a checkpoint is written: stage 05's folder `name` is listed in the run's manifest first. Until the
        next step, torchrun's end (a third Ctrl-C ends it at once) waits for the save (watchdog.heartbeat())."""
        self.doing = f"write {self.args.output_dir / name}"
        if self.watchdog:
            self.watchdog.saving.set()
        if self.sharded and is_rank0():
            ownership.writes(self.args.output_dir, name)

    def check_weights(self, what):
        model, optimizer = self.states["model"], self.states["optimizer"]
        if self.sharded:  # each rank sees its own shards: the verdict is all-reduced on the model's device
            device = next(model.parameters()).device
            divergence.check_weights([model.state_dict(), optimizer.state_dict()], what, self.args.output_dir, device)
        else:
            divergence.check_weights(checkpoint.unwrap(model).state_dict(), what, self.args.output_dir)

    def close(self, together):
        """Stop the heartbeat; with `together`, rank 0 (which serves the store, past the process group's end)
        waits until every rank has left."""
        if self.watchdog:
            self.watchdog.leave(together)


def run(main):
    """main(guard), the last line of every stage: any way it ends, the run ends with one line that says what
    happened and what to do, instead of a traceback; nothing is lost that a checkpoint holds."""
    guard, together = Guard(), True  # together: every rank ends here alike, and rank 0 waits for the others
    signals.stop_at_once()  # until guard.resume(): nothing saved yet, nothing to lose
    try:
        main(guard)
        code = 0
    except signals.Stopped as stopped:
        code, together = signals.say(stopped), False
    except signals.SavedStop as stop:  # a stop every rank agreed on and saved for
        code = stop.code
    except cli.UsageError as err:  # the parser's, or the task's check()
        code = check.refuse(check.said(err))
    except SystemExit as stop:  # the end of a run, a verdict every rank reached, a usage error, or the task's own
        code = stop.code if isinstance(stop.code, int | None) else failure.exit_line(stop.code)
        if failure.raised_by(stop, guard.args and guard.args.task):  # a failure of this rank, even sys.exit(0)
            code, together = failure.settle(stop, guard), False
    except BaseException as err:  # the lesson's refusal (every rank met it) is its line as it is; each
        code = failure.refusal(err)  # kind explain() knows becomes its line, any other the fallback's
        if code is None:
            code, together = failure.settle(err, guard), False
    guard.close(together)
    end(code, joined=guard.watchdog is not None)
