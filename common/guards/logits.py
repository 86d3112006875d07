"""Guard rail: the default loss, cross-entropy, takes logits (or log-probabilities). A model(args) that ends in a
softmax trained on another loss than the one it reported (the softmax's output read as logits), with an accuracy
that still looked right: a plausible wrong number. One forward of the first training input, on the meta device
(shapes alone: no weights, nothing computed), says whether what the model returns is a softmax's, before any
step."""

import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from common.guards.ending import stop

SOFTMAX = {torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}


class Softmaxes(TorchFunctionMode):
    """Keeps each tensor a softmax over dim 1 returns: cross-entropy's classes, of (B, C) and (B, C, ...) alike."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dim = (kwargs or {}).get("dim", args[1] if len(args) > 1 else None)
        if func in SOFTMAX and torch.is_tensor(out) and out.ndim > 1:
            dim = (0 if out.ndim == 3 else 1) if dim is None else dim  # None: F.softmax's implicit one
            if dim % out.ndim == 1:
                self.made.append(out)
        return out


def check(args, task, batch):
    """`batch`: the first training sample, batched as training will; nothing to check for a task's own loss."""
    if hasattr(task, "loss"):
        return
    softmaxes = Softmaxes()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # weights model(args) loads itself: lost on meta, and not needed here
            model = task.model(args).eval()  # eval: BatchNorm refuses a batch of one sample in training
            inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), batch[0])
            with softmaxes:
                output = model(inputs)
    except Exception:  # a model that cannot run on meta: its first step names what fails
        return
    if any(output is made for made in softmaxes.made):
        stop(
            f"error: --task {args.task}: model(args) returns a softmax's probabilities, but the default loss, "
            "cross-entropy, takes logits (or log-probabilities): it would train on another loss than it reports: "
            "return the logits (drop the softmax) or log_softmax's, or define loss(output, target)"
        )
