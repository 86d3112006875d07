"""Guard rail: a run that diverges stops, every rank at the same point, and never saves what diverged.
A non-finite loss is seen at the progress lines (every --log-interval steps: no extra sync per step), a
non-finite epoch result or non-finite weights before the epoch's checkpoint. The last good checkpoint then
survives, to resume with a lower --lr. A non-finite loss from finite weights is one too where the losses or the
model's outputs overflow (of_the_loss()); else it is the loss's own (the default loss on a batch with nothing
labelled), named so."""

import math
import os

import torch
import torch.distributed as dist

from common.guards.ending import stop


def advice(output_dir):
    """What is kept, and what to try: a run may diverge before its first checkpoint."""
    return f"the run diverged; {kept(output_dir)}: try a lower --lr (or --amp off)"


def kept(output_dir):
    saved = any(os.path.lexists(output_dir / name) for name in ("checkpoint.pt", "checkpoint"))
    return f"the checkpoint in {output_dir} keeps the last good epoch" if saved else "nothing was saved yet"


def of_the_loss(default_loss, output_dir, value, overflows):
    """Why a loss is `value`, not finite, where the weights are (checked first). A divergence where the model's
    outputs on two training samples are not finite either (`overflows`), or the default loss is infinite, a sum of
    losses too large (over no label it is nan, never inf): its loss overflows before its weights (--lr 1e10).
    Else no divergence, the loss's own value: the default loss on a batch with nothing labelled was called a
    divergence, with advice to lower --lr."""
    if overflows or (default_loss and math.isinf(value)):
        return f"the weights are finite, but the model's outputs or losses overflow: {advice(output_dir)}"
    if default_loss:
        why = (
            "the default loss, cross-entropy, is nan for a batch whose labels are all -100 (ignored: a mean over "
            "none): define loss() of your own, to which such a batch adds nothing"
        )
    else:
        why = "the task's loss() returned it for a batch (a log of 0, a mean over nothing?)"
    return f"the weights are finite, so the run did not diverge: {why}; {kept(output_dir)}"


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


def loss_finite(sums):
    """Is the summed loss `sums.loss` finite on every rank? It turns non-finite with the first non-finite loss and
    stays so: checked at the progress lines, one all-reduce of one number."""
    bad = torch.isfinite(sums.loss).logical_not().float()
    if dist.is_initialized():
        dist.all_reduce(bad)  # every rank stops at the same batch
    return not bad.item()


def check_epoch(epoch, sums, output_dir, why):
    """`sums`: the all-reduced sums of an epoch (metrics.Epoch), the same on every rank; the weights are finite;
    `why` says why a loss is not finite (Guard.why(): every rank asks)."""
    for name, part in sums._asdict().items():  # training, validation, test
        if not math.isfinite(part.loss):
            loss = f"epoch {epoch} ended with a non-finite {name} loss ({part.loss})"
            stop(f"error: {loss}: {why(part.loss)}")
        if not all(map(math.isfinite, part.score)):  # the task's score(): a relative error of a target of 0
            stop(
                f"error: epoch {epoch} ended with a non-finite {name} score ({', '.join(map(str, part.score))}): "
                "the task's score() must sum finite values over a batch (totals() too), and the default accuracy has "
                "none for a sample whose labels are all -100 (ignored): define a metric of your own (totals() of the "
                f"labels right and labelled); the checkpoint in {output_dir} keeps the last epoch before"
            )


def check_weights(states, what, output_dir, device=None):
    """Before a save, and where the loss is not finite: stop if `states` holds a non-finite tensor, saying `what`
    (which says "not finite") and that the run diverged. With `device`, the verdict is all-reduced there (each
    rank holds only its shards; NCCL reduces GPU tensors only); else every rank holds the same weights and decides
    alike, with no collective."""
    bad = not finite(states)
    if device is not None and dist.is_initialized():
        flag = torch.tensor([float(bad)], device=device)
        dist.all_reduce(flag)
        bad = bool(flag.item())
    if bad:
        stop(f"error: {what}: " + advice(output_dir))
