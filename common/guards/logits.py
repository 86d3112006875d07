"""Guard rail: the default loss, cross-entropy, takes logits (or log-probabilities). A model(args) that returns
probabilities (a softmax's over the classes, or a sigmoid's) trained on another loss than the one it reported
(cross-entropy read them as logits), with an accuracy that still looked right: a plausible wrong number. The run's
first training forward says so, from what autograd recorded of its output (no value read, nothing run twice): one
line before its first backward."""

import torch

from common.guards.ending import stop


def squashed(output):
    """What made `output`, (B, C) or (B, C, ...), if it holds probabilities: "a softmax's" over dim 1, cross-entropy's
    classes, or "a sigmoid's"; else None."""
    made = output.grad_fn
    if type(made).__name__ == "SigmoidBackward0":
        return "a sigmoid's"
    if type(made).__name__ != "SoftmaxBackward0":
        return None
    dim = made._saved_dim  # a negative one as an unsigned 64-bit integer
    return "a softmax's" if (dim - 2**64 if dim >= 2**63 else dim) % output.ndim == 1 else None


def watch(model, task):
    """Look at the output of the first forward of `model` that autograd records (training's, not an evaluation's),
    then no more; `task`: the file, for the line."""

    def first(module, inputs, output):
        if not torch.is_grad_enabled():  # an evaluation first (a resume in one): the training's is the one
            return
        watching.remove()
        made = torch.is_tensor(output) and output.ndim > 1 and output.grad_fn is not None and squashed(output)
        if made:
            stop(
                f"error: --task {task}: model(args) returns probabilities ({made}), but the default loss, "
                "cross-entropy, takes logits (or log-probabilities): it would train on another loss than it reports: "
                "return the logits (drop the last activation) or log_softmax's, or define loss(output, target)"
            )

    watching = model.register_forward_hook(first)
