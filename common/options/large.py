"""Stage 05's --grad-accum (accumulating()): a memory saver. Each rank's batch runs in N slices, one
backward each, the gradients summed and reduced across ranks once, after the last: the activations
of a slice, not of the whole batch, are held at once, for the same update (but for BatchNorm,
whose statistics are each slice's). --checkpoint-activations and --full-shard act in the stage and
in common/distributed.py mesh(); their flags are in common/options/flags.py large().
"""

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from common import data


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
