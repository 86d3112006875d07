"""Guard rail: where a run stands, step by step, for the saves a stop or --checkpoint-minutes makes part-way
through an epoch (saving.py). Each step is counted once here, as the ranks count it when they agree on the step
to stop or save at: a count that grows across epochs, and on through the evaluation batches after them."""

from typing import NamedTuple

from common.metrics import Sums


class Position(NamedTuple):
    """Where the run stands: `step` steps into `epoch`, this rank's training sums there, and
    `count`, a step count that grows across epochs (evaluation batches counting on)."""

    epoch: int
    step: int
    sums: Sums
    count: int


def counted(epoch, step):
    """The step count of `step` steps into `epoch`: it grows across epochs, whatever an epoch's length."""
    return epoch * 2**32 + step


class Progress:
    """Where this run started, (epoch, steps) (resumed part-way through an epoch: steps > 0), and where it stands
    now: the Position after its last training step or evaluation batch, None before the first."""

    def __init__(self):
        self.start_at, self.at = (0, 0), None

    def resumed(self, epoch, step):
        """The run continues a checkpoint saved `step` steps into `epoch`: the lesson trains the rest of it."""
        self.start_at = (epoch, step)

    def stepped(self, epoch, batch, sums):
        """After training step `batch` (counted from 0 in this run's part of `epoch`), with this rank's `sums`."""
        start_epoch, start_step = self.start_at
        step = (start_step if epoch == start_epoch else 0) + batch + 1
        self.at = Position(epoch, step, sums, counted(epoch, step))
        return self.at

    def evaluated(self, so_far):
        """After an evaluation batch: the Position of the last training step, counted one on, or None before this
        run's first step (a test's evaluation). Resumed with no step left, the training the checkpoint holds:
        so_far(epoch), its sums."""
        epoch, step = self.start_at
        if self.at is None and step:
            self.at = Position(epoch, step, so_far(epoch), counted(epoch, step))
        if self.at is not None:
            self.at = self.at._replace(count=self.at.count + 1)
        return self.at
