"""The guard rails of a run, attached to the lesson where they act. A stage hands its main() to run(), which
makes one Guard and passes it in; every line of the stage that uses it names what it guards, and a learner
may skip each of them: the training reads the same without. What each one holds off is in tests/FAILURES.md.

  start()         before the process group: one run per output folder, a launch that can work, and a bounded
                  rendezvous that names who did not come (the store setup() meets in)
  agree()         before the first step: every rank trains the same run on the same data
  resumable()     an epoch that can be resumed part-way, at the sample where it stopped
  resume()        which checkpoint this run continues, if any, and whether it may; signals are caught from here
  end_of_step()   a diverged loss stops the run; a signal (SIGTERM, SIGUSR1) or --checkpoint-minutes saves here
  check_epoch()   nothing non-finite is ever saved
  run(main)       any failure ends the run with one line instead of a traceback
"""

import os
import re
import shutil
import sys
import time
import traceback

import torch
import torch.distributed as dist

from common import checkpoint, distributed
from common.environment import is_rank0
from common.guards import check, divergence, lock, preflight, resume, safeload, samples
from common.guards.ending import end
from common.guards.preemption import Preemption
from common.guards.watchdog import Watchdog


class Guard:
    def __init__(self):
        self.args, self.lock, self.watchdog, self.preemption = None, None, None, None
        self.sampler, self.states, self.sharded, self.epoch_done, self.so_far = None, None, False, None, None
        self.doing = None  # a stage 05 checkpoint read or written from here on: for a failure's one line
        self.data = None  # the training set's fingerprint (preflight.fingerprint())

    def start(self, args):
        """Claim --output-dir, check the launch, and meet the other ranks: returns the rendezvous store for
        distributed.setup(), or None without a launcher."""
        self.args = args
        check.check_environment()  # every launcher variable, before anything reads it
        check.check_args(args, gpus=0 if args.no_cuda else torch.cuda.device_count())
        self.lock = lock.claim(args.output_dir)  # first: one run per folder, and a folder it can write
        lock.sweep(args.output_dir)
        return self.meet(args)

    def meet(self, args):
        """start() but the output folder: check the launch and meet the other ranks (the doctor's start too)."""
        check.check_environment()
        launch = distributed.launcher()
        preflight.check_launch(launch, args)  # numbers that fit together, before anyone waits for anyone
        preflight.check_device(args, launch.local_rank)
        if not launch.addr:
            return None
        preflight.check_interfaces("nccl" if torch.cuda.is_available() and not args.no_cuda else "gloo")
        self.watchdog = Watchdog()
        store = self.watchdog.rendezvous(launch, args.dist_timeout)  # bounded, and naming who did not come
        self.watchdog.watch()  # heartbeats: a failed collective names the rank that went silent
        return store

    def agree(self, train_set, test_set, task):
        """Every rank trains the same run on the same data; the checkpoints record what it is trained on."""
        preflight.agree(self.args, task, train_set, test_set)  # first: it says in one line what a task's data lacks
        self.data = preflight.fingerprint(train_set)

    def resumable(self, sampler):
        """`sampler`, made able to start an epoch part-way (resume.Sampler)."""
        self.sampler = resume.Sampler(sampler, self.args.seed)
        return self.sampler

    def resume(self, states, sharded=False):
        """The checkpoint this run continues (or None), for checkpoint.restore(): the one of this folder after a
        requeue or a torchrun restart, or --resume's, refused in one line where it is not this run's. From here
        on SIGTERM and SIGUSR1 stop the run at a step all ranks agree on, and end_of_step() saves it."""
        self.states, self.sharded = states, sharded
        if sharded and dist.is_initialized():
            preflight.check_shared(self.args.output_dir)
        self.preemption = Preemption(self.watchdog, self.args.dist_timeout)
        self.preemption.catch()
        if self.watchdog:  # a rank may hear of the stop from the store before its own signal arrives
            self.watchdog.listen(self.preemption.poll)
        state = resume.state_to_resume(self.args, sharded, self.data)
        if state is not None and state["folder"]:  # every rank reads its shards: .metadata too, building nothing else
            state["reader"] = safeload.reader(state["folder"])
            self.doing = f"read {state['folder']}"
        if state is not None and state["step"]:  # saved mid-epoch: the rest of it, and its sums and time so far
            self.sampler.resume_at(state["epoch"], state["step"] * self.args.batch_size)
            states["log"].cut = state["run"]["cut"]
        return state

    def end_of_step(self, epoch, batch, totals):
        """After training step `batch` (counted from 0 in this run's part of the epoch): every --log-interval
        steps, stop if the loss went non-finite on any rank; on a signal, save at the step all ranks agreed on
        and end the run; with --checkpoint-minutes, save when they have passed."""
        args, step = self.args, self.sampler.skipped() // self.args.batch_size + batch + 1
        if self.epoch_done is not None:  # the time since check_epoch(): the epoch's checkpoint, an upper bound
            self.preemption.saved(time.monotonic() - self.epoch_done)
            self.epoch_done = None
        self.doing = None
        count = epoch * 2**32 + step  # a step count that grows across epochs
        if batch % args.log_interval == 0:
            divergence.check_loss(epoch, step - 1, totals, args.output_dir)
        if self.preemption.check(count):
            self.save(epoch, step, totals)
            distributed.print0(f"saved at epoch {epoch}, step {step}: resume with --resume ({self.preemption.signal})")
            raise SystemExit(self.preemption.exit_code())
        if args.checkpoint_minutes and self.preemption.due(args.checkpoint_minutes, count):
            self.save(epoch, step, totals)
            distributed.print0(f"saved at epoch {epoch}, step {step} (--checkpoint-minutes {args.checkpoint_minutes})")

    def save(self, epoch, step, totals):
        """A checkpoint `step` steps into `epoch`: the sums and time so far go with it, so that the resumed
        run's row in metrics.csv counts the whole epoch."""
        started, log = time.monotonic(), self.states["log"]
        totals = totals.clone()
        if dist.is_initialized():
            dist.all_reduce(totals)
        earlier = log.cut[1] if log.cut[0] == epoch else [0.0, 0.0]
        self.so_far = (
            epoch,
            [a + b for a, b in zip(totals.tolist(), earlier, strict=True)],
            log.seconds(totals.device),
        )
        self.check_weights(f"epoch {epoch} left weights that are")
        if not self.sharded:
            resume.keep_previous(self.args.output_dir)
        self.doing = f"write {self.args.output_dir / f'epoch-{epoch}-step-{step}'}"
        (checkpoint.save_sharded if self.sharded else checkpoint.save)(self.args.output_dir, epoch, self.states, step)
        self.preemption.saved(time.monotonic() - started)
        self.so_far = None

    def check_epoch(self, epoch, totals):
        """Before the epoch's row and checkpoint: its all-reduced losses and the weights must be finite; the
        checkpoint the epoch's replaces stays as checkpoint-previous.pt."""
        divergence.check_epoch(epoch, totals, self.args.output_dir)
        self.check_weights(f"epoch {epoch} left weights that are")
        if not self.sharded:
            resume.keep_previous(self.args.output_dir)
        self.doing = f"write {self.args.output_dir / f'epoch-{epoch}'}"
        self.epoch_done = time.monotonic()

    def check_weights(self, what):
        model, optimizer = self.states["model"], self.states["optimizer"]
        if self.sharded:  # each rank sees its own shards: the verdict is all-reduced on the model's device
            device = next(model.parameters()).device
            divergence.check_weights([model.state_dict(), optimizer.state_dict()], what, self.args.output_dir, device)
        else:
            divergence.check_weights(checkpoint.unwrap(model).state_dict(), what, self.args.output_dir)

    def state_dict(self):
        """What a checkpoint keeps of how the run was made (the stage puts the guard among its states), to
        refuse a resume that would change it (resume.find()); and the size of the model, for tools/scaling.py:
        the whole model's, where each rank holds a shard too (a sharded parameter has its global shape)."""
        parameters = sum(p.numel() for p in self.states["model"].parameters())
        return {"flags": preflight.defining(self.args), "data": self.data, "cut": self.so_far, "parameters": parameters}

    def load_state_dict(self, state):
        """Nothing to load: resume() compared the checkpoint with this run before anything was loaded."""

    def close(self, together):
        """Stop the heartbeat; with `together`, rank 0 (which serves the store) waits until every rank has left."""
        if self.watchdog:
            self.watchdog.leave(together)


def run(main):
    """main(guard), the last line of every stage: any way it ends, the run ends with one line that says what
    happened and what to do, instead of a traceback; nothing is lost that a checkpoint holds."""
    guard, together = Guard(), True  # together: every rank ends here alike, and rank 0 waits for the others
    try:
        main(guard)
        code = 0
    except KeyboardInterrupt:
        if is_rank0():  # Ctrl-C reaches every rank of the terminal's launch: one says it
            print("error: interrupted (Ctrl-C): the checkpoint of the last finished epoch is kept in --output-dir: "
                  "continue with --resume", file=sys.stderr, flush=True)  # fmt: skip
        code, together = 130, False  # the shell's code for a run ended by SIGINT
    except SystemExit as stop:  # the end of a run, a verdict every rank reached, or a usage error
        code = stop.code
    except BaseException as err:  # each kind explain() knows becomes one line (CheckpointException is no Exception)
        code, together = explain(err, guard), False
        if code is None and guard.watchdog is None:
            raise
        if code is None:  # a rank of a process group: the traceback, then no teardown that could hang or abort
            traceback.print_exc()
            code = 1
    guard.close(together)
    end(code, joined=guard.watchdog is not None)


def explain(err, guard):
    """One line for the errors a run meets from outside its code, or None."""
    if guard.args is None and isinstance(err, (OSError, SyntaxError)):  # reading the options: the task file
        where = f", line {err.lineno}" if isinstance(err, SyntaxError) else ""
        return once(f"error: --task {err.filename}{where}: {getattr(err, 'strerror', None) or err.msg}: give a task "
                    "file as common/tasks/images.py is one")  # fmt: skip
    if isinstance(err, AttributeError) and getattr(err.obj, "__name__", "").startswith("task_"):
        return once(f"error: --task {err.obj.__file__} defines no {err.name}(): a task defines model(args) and "
                    "datasets(args), as common/tasks/images.py does")  # fmt: skip
    if isinstance(err, AttributeError) and err.name == "to" and guard.args is not None:  # task.model(args).to()
        return once(f"error: --task {guard.args.task}: model(args) returned a {type(err.obj).__name__}, not a "
                    "torch.nn.Module")  # fmt: skip
    raised = traceback.extract_tb(err.__traceback__)[-1].line or ""  # the source line, where Python finds it
    if isinstance(err, (TypeError, ValueError)) and "task.datasets(" in raised:  # unpacking what datasets() returned
        return once(f"error: --task {guard.args.task}: datasets(args) must return (training set, test set), two "
                    f"torch.utils.data Datasets of (input, label) pairs ({err})")  # fmt: skip
    if guard.args is not None and (message := samples.explain(err, guard.args.task)):  # a label, a collate()
        return message
    if guard.watchdog and (message := guard.watchdog.explain(err)):  # a failed collective: who went silent
        return message
    # "DataLoader worker (pid(s) 812) exited unexpectedly", caused by "... (pid 812) is killed by signal: Killed."
    lost = re.match(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is )?(.*?)\.?\s*$", str(err.__cause__ or err))
    if isinstance(err, RuntimeError) and lost:
        return (f"error: a DataLoader worker of this rank (pid {lost[1]}) ended ({lost[2]}), most likely killed by the "
                "out-of-memory killer: use fewer --num-workers, or ask for more memory (#SBATCH --mem); then continue "
                "with --resume")  # fmt: skip
    if isinstance(err, OSError) and err.filename:  # a write: checkpoint.atomic() removed its temporary file
        folder = guard.args.output_dir if guard.args else "."
        return (f"error: could not write {err.filename}: {err.strerror} ({free_mib(folder):.0f} MiB free there): the "
                f"previous {os.path.basename(err.filename)} is kept; free some space or choose another --output-dir, "
                "then resume")  # fmt: skip
    if type(err).__name__ == "CheckpointException":  # torch.distributed.checkpoint: every rank gets all failures
        verb, folder = (guard.doing or "read or write the checkpoint in --output-dir").split(" ", 1)
        if verb == "read":  # every rank gets every rank's failures: rank 0 says it
            return once(
                f"error: cannot load the checkpoint {folder}: {safeload.describe(err)}: resume from a complete one"
            )
        return once(f"error: could not write {folder}: {safeload.describe(err)} ({free_mib(guard.args.output_dir):.0f} MiB free "
                "there): the previous checkpoint is kept; free some space or choose another --output-dir, then resume")  # fmt: skip
    if isinstance(err, RuntimeError) and str(err).startswith("Error(s) in loading state_dict"):
        return f"error: the checkpoint does not match this model: {str(err).splitlines()[0][:300]}"
    return None


def once(message):
    """A verdict every rank reaches alike: rank 0 says it, the others end with status 1."""
    return message if is_rank0() else 1


def free_mib(folder):
    return shutil.disk_usage(folder).free / 2**20
