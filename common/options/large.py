"""Stage 05's memory savers. --grad-accum (accumulating()): each rank's batch runs in N slices, one
backward each, the gradients summed and reduced across ranks once, after the last: the activations
of a slice, not of the whole batch, are held at once, for the same update (but for BatchNorm,
whose statistics are each slice's). --checkpoint-activations (recomputed()): a block keeps its
input alone and runs again in the backward. --full-shard acts in common/distributed.py mesh();
the flags are in common/options/flags.py large().
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint as recompute
from torch.utils import _pytree as pytree

from common import data
from common.options import compiling


def per_unit(units, args, log):
    """Stage 05's flags acting on each unit before it is sharded: --checkpoint-activations, then
    --compile (common/options/compiling.py units())."""
    for unit in units if args.checkpoint_activations else []:
        recomputed(unit)
    if args.compile:
        compiling.units(units, log)


def recomputed(unit):
    """`unit` keeps its input alone and runs again in its backward, with its forward's random state
    (dropout's masks) and, after, its buffers as the forward left them: BatchNorm in training mode
    updates its statistics in every run, and they count one a step, as without the flag."""

    @contextlib.contextmanager
    def buffers_kept():
        kept = [(b, b.clone()) for b in unit.buffers()]
        try:
            yield
        finally:  # also when the recomputation stops early, having made what the backward needs
            written = torch.stack([(b != k).any() for b, k in kept]).tolist() if kept else []
            for (b, before), changed in zip(kept, written, strict=True):  # one GPU sync in all
                if changed:  # a buffer it left alone (a mask) keeps its autograd version
                    b.copy_(before)

    return recompute(unit, context_fn=lambda: (contextlib.nullcontext(), buffers_kept()))


def accumulating(step, micro_batches):
    """`step` running each batch in `micro_batches` slices; its training step returns the mean."""

    def train_step(step, x, y):
        loss, model = 0, step.model
        micro = [*zip(chunk(x, micro_batches), chunk(y, micro_batches), strict=True)]
        for i, (xm, ym) in enumerate(micro):
            if dist.is_initialized() and len(micro) > 1:  # reduce once, after the last slice
                model.set_requires_gradient_sync(i == len(micro) - 1)
            part = step.loss_fn(model(xm), ym) * data.count(ym) / data.count(y)  # its share
            part.backward()
            loss += part.detach()
        step.optimizer.step()
        return loss

    return step._replace(run=train_step)


def chunk(batch, parts):
    """`batch` in at most `parts` slices of samples, each nested as `batch` is."""
    slices = len(next(t for t in pytree.tree_leaves(batch) if torch.is_tensor(t)).chunk(parts))
    return [
        pytree.tree_map_only(torch.Tensor, lambda t, i=i: t.chunk(parts)[i], batch)
        for i in range(slices)
    ]
