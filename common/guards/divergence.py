"""Guard rail: a run that diverges stops, every rank at the same point, and never saves what diverged.
A non-finite loss is seen at the progress lines (every --log-interval steps: no extra sync per step), a
non-finite epoch result or non-finite weights before the epoch's checkpoint. The last good checkpoint then
survives, to resume with a lower --lr."""

import math
import os

import torch
import torch.distributed as dist

from common.guards.ending import stop


def advice(output_dir):
    """What is kept, and what to try: a run may diverge before its first checkpoint."""
    saved = any(os.path.lexists(output_dir / name) for name in ("checkpoint.pt", "checkpoint"))
    kept = f"the checkpoint in {output_dir} keeps the last good epoch" if saved else "nothing was saved yet"
    return f"the run diverged; {kept}: try a lower --lr (or --amp off)"


def finite(state):
    """Are all the floating-point tensors in `state` (nested dicts and lists) finite? Of a sharded tensor,
    the shard this rank holds."""
    if hasattr(state, "to_local"):  # a DTensor (not imported: it costs every stage 0.4 s)
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, (dict, list, tuple)):
        return all(finite(v) for v in (state.values() if isinstance(state, dict) else state))
    return True


def check_loss(epoch, batch, sums, output_dir):
    """At a progress line: stop every rank if the summed loss `sums.loss` is not finite on any of
    them (it turns so with the first non-finite loss and stays so). One all-reduce of one number."""
    bad = torch.isfinite(sums.loss).logical_not().float()
    if dist.is_initialized():
        dist.all_reduce(bad)  # every rank stops at the same batch
    if bad.item():
        stop(f"error: the training loss is not finite by epoch {epoch}, batch {batch}: " + advice(output_dir))


def check_epoch(epoch, sums, output_dir):
    """`sums`: the all-reduced sums of an epoch (metrics.Epoch), the same on every rank."""
    for name, part in sums._asdict().items():  # training, validation, test
        if not math.isfinite(part.loss):
            stop(f"error: epoch {epoch} ended with a non-finite {name} loss ({part.loss}): " + advice(output_dir))
        if not all(map(math.isfinite, part.score)):  # the task's score(): a relative error of a target of 0
            stop(
                f"error: epoch {epoch} ended with a non-finite {name} score ({', '.join(map(str, part.score))}): "
                "the task's score() must sum finite values over a batch (totals() too), and the default accuracy has "
                "none for a sample whose labels are all -100 (ignored): define a metric of your own (totals() of the "
                f"labels right and labelled); the checkpoint in {output_dir} keeps the last epoch before"
            )


def check_weights(states, what, output_dir, device=None):
    """Before a save: stop if `states` holds a non-finite tensor. With `device`, each rank holds only its
    shards, and the verdict is all-reduced there (NCCL reduces GPU tensors only); else every rank holds
    the same weights and decides alike, with no collective."""
    bad = not finite(states)
    if device is not None and dist.is_initialized():
        flag = torch.tensor([float(bad)], device=device)
        dist.all_reduce(flag)
        bad = bool(flag.item())
    if bad:
        stop(f"error: {what} not finite: " + advice(output_dir))
