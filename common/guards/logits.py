"""Guard rail: the default loss, cross-entropy, takes logits (or log-probabilities). A model(args) that returns a
softmax's probabilities trained on another loss than the one it reported (cross-entropy read them as logits), with
an accuracy that still looked right: a plausible wrong number. The run's first training forward says so, from what
autograd recorded of its output (no value read, nothing run twice): one line before its first backward."""

import torch

from common.guards.ending import stop


def softmaxed(output):
    """Is `output`, (B, C) or (B, C, ...), what a softmax over dim 1, cross-entropy's classes, returned?"""
    made = output.grad_fn
    if type(made).__name__ != "SoftmaxBackward0" or output.ndim < 2:
        return False
    dim = made._saved_dim  # a negative one as an unsigned 64-bit integer
    return (dim - 2**64 if dim >= 2**63 else dim) % output.ndim == 1


def watch(model, task):
    """Look at the output of the first forward of `model` that autograd records (training's, not an evaluation's),
    then no more; `task`: the file, for the line."""

    def first(module, inputs, output):
        if not torch.is_grad_enabled():  # an evaluation first (a resume in one): the training's is the one
            return
        watching.remove()
        if torch.is_tensor(output) and output.grad_fn is not None and softmaxed(output):
            stop(
                f"error: --task {task}: model(args) returns a softmax's probabilities, but the default loss, "
                "cross-entropy, takes logits (or log-probabilities): it would train on another loss than it reports: "
                "return the logits (drop the softmax) or log_softmax's, or define loss(output, target)"
            )

    watching = model.register_forward_hook(first)
