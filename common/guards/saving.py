"""Guard rail: the agreement on where to stop and save. From Guard.resume() on, a stop (SIGTERM, SIGUSR1, Ctrl-C)
or --checkpoint-minutes saves at a step every rank agrees on (preemption.py), part-way through an epoch or
between two evaluation batches; nothing non-finite is ever saved; and while a checkpoint is written, a failure's
line names it and torchrun's end waits for it (watchdog.heartbeat())."""

import math
import os
import shutil
import time
from dataclasses import asdict
from typing import NamedTuple

import torch
import torch.distributed as dist

from common import checkpoint, distributed, sharded
from common.environment import is_rank0
from common.guards import divergence, identity, ownership, resume, signals
from common.guards.ending import stop
from common.guards.preemption import Preemption
from common.metrics import Sums


def keep_previous(output_dir):
    """Rank 0, before checkpoint.pt is replaced: the one it replaces stays as checkpoint-previous.pt (a hard
    link, switched in atomically; a copy on a filesystem without hard links)."""
    if not is_rank0() or not (output_dir / checkpoint.WHOLE).is_file():
        return
    link = output_dir / f"{resume.PREVIOUS}.tmp{os.getpid()}"
    link.unlink(missing_ok=True)
    try:
        os.link(output_dir / checkpoint.WHOLE, link)
    except OSError:
        shutil.copyfile(output_dir / checkpoint.WHOLE, link)
    os.replace(link, output_dir / resume.PREVIOUS)


class Cut(NamedTuple):
    """The lesson's metrics.Log as a checkpoint saved part-way through an epoch keeps it: its rows, and the
    epoch's time and each rank's training sums so far (common/options/resuming.py hands them back)."""

    log: object
    cut: dict

    def state_dict(self):
        return self.log.state_dict() | {"cut": self.cut}


class Buffers(NamedTuple):
    """Stage 05's floating-point buffers of every rank, on rank 0, as a checkpoint saved part-way keeps them: FSDP
    shards none, and until an evaluation averages them (distributed.average_buffers) each rank's BatchNorm statistics
    are its own (common/options/resuming.py set_buffers() puts them back)."""

    everyone: list

    @classmethod
    def gathered(cls, model):
        mine = {name: b.detach().cpu() for name, b in model.named_buffers() if b.is_floating_point()}
        everyone = [mine] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.gather_object(mine, everyone if is_rank0() else None)
        return cls(everyone)

    def state_dict(self):
        return self.everyone


class Saving:
    """The saves of a run whose `states` (the lesson's, watched) may be `sharded` (stage 05), where `progress`
    (progress.Progress) says it started; `watchdog`: the process group's (None without one); `hold`: the folder
    rank 0 took (identity.held()). `doing`: the checkpoint being read or written, for a failure's line."""

    def __init__(self, args, states, sharded, watchdog, progress, hold=None):
        self.args, self.states, self.sharded, self.watchdog, self.progress = args, states, sharded, watchdog, progress
        self.hold = hold
        self.doing, self.saved_at, self.epoch_done = None, (0, 0), None  # saved_at: (epoch, step) of a stop's save
        self.preemption, self.steps = None, None  # steps: of an epoch (recorded.declared())

    def catch(self):
        """From here on, SIGTERM and SIGUSR1 stop the run at a step all ranks agree on (preemption.py)."""
        self.preemption = Preemption(self.watchdog, self.args.dist_timeout)
        self.preemption.catch()
        if self.watchdog:  # a rank may hear of the stop from the store before its own signal arrives
            self.watchdog.listen(self.preemption.poll)

    def stepped(self, at):
        """After a training step, at `at`: the epoch's checkpoint, if one was written since, is whole; at the epoch's
        last step, the generators are held for a save in its evaluation (randomness.Generators.hold())."""
        if at.step == self.steps and "rng" in self.states:  # once an epoch: no cost a step
            self.states["rng"].hold(at.epoch)
        if self.epoch_done is not None:  # the time since check_epoch(): the epoch's checkpoint, an upper bound
            self.preemption.saved(time.monotonic() - self.epoch_done)
            self.epoch_done = None
        self.doing = None
        if self.watchdog:
            self.watchdog.saving.clear()

    def stop_or_save(self, at, evaluating=False):
        """At `at` (a progress.Position): on a stop, save at the step all ranks agreed on and end the run; with
        --checkpoint-minutes, save when they have passed. `evaluating`: in evaluate(), after the epoch's training."""
        minutes = self.args.checkpoint_minutes  # a node without it saves where another node's clock asks
        if self.preemption.check(at.count):
            self.save(at.epoch, at.step, at.sums, evaluating)
            distributed.print0(
                f"saved at epoch {at.epoch}, step {at.step}: resume with --resume ({self.preemption.signal})"
            )
            raise signals.SavedStop(self.preemption.exit_code())
        if self.preemption.due(minutes or math.inf, at.count) and self.save(at.epoch, at.step, at.sums, evaluating):
            distributed.print0(
                f"saved at epoch {at.epoch}, step {at.step} (--checkpoint-minutes {minutes or 'elsewhere'})"
            )

    def save(self, epoch, step, sums, evaluating=False):
        """A checkpoint `step` steps into `epoch`: the sums and time so far go with it (its "cut"),
        so that the resumed run's row in metrics.csv counts the whole epoch. One there already (a stop in the
        evaluation a resumed run runs again, a second --checkpoint-minutes in one evaluation) stands as it is:
        the same step, and writing it again would replace the checkpoint a resume needs while it is written.
        In an evaluation, the time is the training's: the stage's log.seconds() after train(), as its row counts it.
        Returns whether it wrote one."""
        if (epoch, step) in (self.progress.start_at, self.saved_at):
            self.preemption.saved_at = time.monotonic()  # what is saved is the state now: the minutes count anew
            return False
        started, log, mine = time.monotonic(), self.states["log"], sums.tensor()
        parts = [mine.clone() for _ in range(dist.get_world_size() if dist.is_initialized() else 1)]
        if dist.is_initialized():  # each rank's own sums (the epoch's part before a resume included): carried()
            dist.all_gather(parts, mine)
        total = asdict(Sums(*torch.stack(parts).sum(0).tolist()))
        ranks = [asdict(Sums(*part.tolist())) for part in parts]
        seconds = log.took if evaluating else log.seconds(mine.device)  # not the evaluation's too
        cut = {"epoch": epoch, "seconds": seconds, "training": total, "ranks": ranks, "compiled": log.compiled}
        self.check_weights(f"epoch {epoch} left weights that are not finite")
        identity.check_held(self.hold)  # the folder the run took, still at its path: else it writes nowhere
        if not self.sharded:
            keep_previous(self.args.output_dir)
        self.writing(f"epoch-{epoch}-step-{step}", evaluating and epoch)
        states = self.states | {"log": Cut(log, cut)}  # the lesson's states as they are, the log with its cut
        if self.sharded:  # each rank's own statistics: the shards hold one copy
            states["buffers"] = Buffers.gathered(self.states["model"])
        (sharded.save if self.sharded else checkpoint.save)(self.args.output_dir, epoch, states, step)
        self.preemption.saved(time.monotonic() - started)
        self.saved_at = (epoch, step)
        return True

    def so_far(self, epoch):
        """The training sums of `epoch` the checkpoint this run resumed holds (the log carries them)."""
        _, sums = self.states["log"].carried[epoch]
        return sums

    def epoch_end(self, epoch):
        """Before the epoch's row and checkpoint: the folder is the run's still; the checkpoint it replaces stays as
        the previous one."""
        identity.check_held(self.hold)  # a folder moved or replaced, or its lock gone: no write lands elsewhere
        if not self.sharded:
            keep_previous(self.args.output_dir)
        self.writing(f"epoch-{epoch}")
        self.epoch_done = time.monotonic()

    def writing(self, name, evaluating=None):
        """Before a checkpoint is written: stage 05's folder `name` is listed in the run's manifest first, and what a
        save of it killed half-way left there goes. Until the next step, torchrun's end (a third Ctrl-C ends it at
        once) waits for the save (watchdog.heartbeat()). `evaluating`: the epoch whose evaluation it is saved in."""
        self.doing = f"write {self.args.output_dir / name}"
        if self.watchdog:
            self.watchdog.saving.set()
        if "rng" in self.states:  # each rank's generators, for rank 0 to write
            self.states["rng"].gather(evaluating)
        if self.sharded and is_rank0():
            ownership.writes(self.args.output_dir, name)
            shutil.rmtree(self.args.output_dir / name, ignore_errors=True)
        if self.sharded and dist.is_initialized():
            dist.barrier()  # no rank writes into the folder before it is gone

    def check_loss(self, epoch, step, sums, why):
        """At a progress line: a training loss not finite on any rank stops every rank, as a divergence where the
        weights are not finite either, else saying `why` of its value (Guard.why())."""
        if not divergence.loss_finite(sums):
            model = self.states["model"]  # one verdict on every rank, though a fault made one rank's alone non-finite
            device = next(model.parameters()).device if dist.is_initialized() else None
            at = f"by epoch {epoch}, batch {step}"
            divergence.check_weights(
                checkpoint.unwrap(model).state_dict(),
                f"the training loss and the weights are not finite {at}",
                self.args.output_dir,
                device,
            )
            loss = f"the training loss is not finite {at}"
            stop(f"error: {loss}: {why(float(sums.loss))}")

    def check_weights(self, what):
        """The weights and the optimizer's state finite, or every rank ends in one line (divergence.py)."""
        model, optimizer = self.states["model"], self.states["optimizer"]
        if self.sharded:  # each rank sees its own shards: the verdict is all-reduced on the model's device
            device = next(model.parameters()).device
            divergence.check_weights([model.state_dict(), optimizer.state_dict()], what, self.args.output_dir, device)
        else:
            divergence.check_weights(checkpoint.unwrap(model).state_dict(), what, self.args.output_dir)
