"""Guard rail: a batch that does not fit the loss or the batching, told by the rank that met it in one line naming
the task and the fix: a label outside the model's outputs, outputs and labels of shapes or dtypes cross-entropy does
not take, a collate() that failed on a later batch, a /dev/shm too small for the workers' batches."""

import re

import torch

from common.guards import samples


def explain(err, task):
    """One line for a label outside the model's outputs, or a collate() that failed on a later batch; else None.
    Said by the rank that met it: the others may have had no such label or batch."""
    frames = [frame for frame, _ in traceback_frames(err)]
    outside = re.search(r"Target (-?\d+) is out of bounds", str(err))
    losses = [f.f_locals["input"] for f in frames if f.f_code.co_name in ("cross_entropy", "nll_loss")]
    if outside and losses and torch.is_tensor(losses[0]) and losses[0].ndim > 1:
        count = losses[0].shape[1]
        return (
            f"error: --task {task}: a label {outside[1]}, but the model has {count} outputs (labels 0 to "
            f"{count - 1}): give model(args) one output per class, or labels in that range"
        )
    if re.search(r"Expected target size .*, got", str(err)) and losses and torch.is_tensor(losses[0]):
        if any(f.f_code.co_filename == str(task) for f in frames):  # the task's loss() calls it: its own code
            return (
                f"error: --task {task}: its loss(output, target) gives cross-entropy outputs of shape "
                f"{list(losses[0].shape)} that do not fit ({str(err)[:80]}): it takes outputs (B, C, ...) with labels "
                "(B, ...), classes in dim 1, e.g. F.cross_entropy(output.flatten(0, 1), target.flatten()) for (B, T, C)"
                "; and the stages cut a batch in dim 0 (an evaluation's padding): the model's outputs start with it"
            )
        return (
            f"error: --task {task}: the default loss, cross-entropy, takes outputs (B, C, ...) with labels (B, ...), "
            f"classes in dim 1: outputs of shape {list(losses[0].shape)} do not fit ({str(err)[:80]}): define "
            "loss(output, target), e.g. F.cross_entropy(output.flatten(0, 1), target.flatten()) for (B, T, C)"
        )
    targets = [f.f_locals.get("target") for f in frames if f.f_code.co_name in ("cross_entropy", "nll_loss")]
    labels = targets[0] if targets and torch.is_tensor(targets[0]) else None
    if "target" in str(err) and labels is not None and labels.ndim > 1 and labels.shape[-1] == 1:  # [B, 1] labels
        return (
            f"error: --task {task}: a batch of labels of shape {list(labels.shape)}, but the loss takes one class "
            "index per sample (shape [B]): return each label as an int (label.squeeze(), label.item())"
        )
    if "Expected more than 1 value per channel when training" in str(err):  # BatchNorm, a batch of one sample
        return (
            f"error: --task {task}: a training batch of one sample reached BatchNorm, which needs two to "
            "normalize: choose a --batch-size (per rank) that leaves no last batch of one, or --limit the set"
        )
    if labels is not None and re.search(r"expected (target dtype to be|scalar type) Long", str(err)):  # int32, bool
        return (
            f"error: --task {task}: labels of dtype {labels.dtype}, but the default loss, cross-entropy, takes class "
            "numbers of int64: return each label as an int, or a tensor .long() (or define loss(output, target))"
        )
    if losses and not torch.is_tensor(losses[0]) and "must be Tensor" in str(err):  # {"logits": ...}, (logits, aux)
        return (
            f"error: --task {task}: model(args) returns a {type(losses[0]).__name__}, but the default loss, "
            "cross-entropy, takes one tensor of outputs (B, C, ...): return it, or define loss(output, target)"
        )
    return batching(err, frames, task)


def batching(err, frames, task):
    """One line for a batch the workers could not hand over, or a collate() that failed; else None."""
    if "shared memory" in str(err) and "No space left on device" in str(err):  # a worker's batch, in /dev/shm
        return (
            f"error: /dev/shm is full ({str(err).splitlines()[-1][:120]}): DataLoader workers hand their batches over "
            "there (a container's is 64 MB by default): give it more (docker --shm-size), or --num-workers 0"
        )
    collates = [f for f in frames if "collate" in f.f_code.co_name and f.f_code.co_filename != samples.__file__]
    if collates:
        code = collates[0].f_code
        batch = collates[0].f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        return (
            f"error: --task {task}: batching samples of shapes {samples.shapes(batch)} failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:150]}): define (or fix) collate(samples) in the task (README)"
        )
    if "in DataLoader worker" in str(err) and "collate" in str(err):  # the worker's traceback, as text
        return (
            f"error: --task {task}: batching samples failed in a DataLoader worker ({str(err).splitlines()[-1][:150]}): "
            "--num-workers 0 names their shapes; define (or fix) collate(samples) in the task (README)"
        )
    return None


def traceback_frames(err):
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
