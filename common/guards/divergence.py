"""Guard rail: a run that diverges stops, every rank at the same point, and never saves what diverged.
A non-finite loss is seen where the loop already waits for the loss (the progress line: no extra sync
per step), a non-finite epoch result before its checkpoint, non-finite weights before any write. The
last good checkpoint then survives, to resume with a lower --lr."""

import math

import torch
import torch.distributed as dist

from common.distributed import stop
from common.rundir import finite

ADVICE = "the run diverged; the checkpoint in {0} keeps the last good epoch: try a lower --lr (or --amp off)"


def check_loss(epoch, batch, loss, totals, output_dir):
    """At a progress line: stop every rank if the summed loss `totals[0]` is not finite on any of them (it
    turns so with the first non-finite loss and stays so). Returns rank 0's `loss`, read in the same sync."""
    bad = torch.isfinite(totals[:1]).logical_not().to(loss.dtype)
    if dist.is_initialized():
        dist.all_reduce(bad)  # every rank stops at the same batch
    loss, bad = torch.cat([loss.detach().reshape(1), bad]).tolist()
    if bad:
        stop(f"error: the training loss is not finite by epoch {epoch}, batch {batch} (rank 0's: {loss}): "
             + ADVICE.format(output_dir))  # fmt: skip
    return loss


def check_epoch(epoch, losses, output_dir):
    """The all-reduced losses of an epoch ({"training": ..., "test": ...}), the same on every rank."""
    for name, value in losses.items():
        if not math.isfinite(value):
            stop(f"error: epoch {epoch} ended with a non-finite {name} loss ({value}): " + ADVICE.format(output_dir))


def check_weights(state, what, output_dir, device=None):
    """Before a save: stop if `state` holds a non-finite tensor. With `device`, each rank holds only its
    shards, and the verdict is all-reduced there (NCCL reduces GPU tensors only); else every rank holds
    the same weights and decides alike, with no collective."""
    bad = not finite(state)
    if device is not None and dist.is_initialized():
        flag = torch.tensor([float(bad)], device=device)
        dist.all_reduce(flag)
        bad = bool(flag.item())
    if bad:
        stop(f"error: {what} not finite: " + ADVICE.format(output_dir))
