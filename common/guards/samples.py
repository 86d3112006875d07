"""Guard rail: a task's samples and batches, named in one line where they do not fit: a collate() that fails
(with the shapes it was given), a batch that is no (input, label) pair, a label the model has no output for, an
epoch that counted fewer samples than its sets hold; and its file of whole weights, checked before stage 05 loads
it."""

import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from common.data import count
from common.environment import is_rank0
from common.guards.bounded import Refused, torch_file
from common.guards.ending import stop


def shapes(batch):
    """The shapes of the tensors in `batch` (samples, nested) for an error line: [[5], 7] or {'ids': [5]}."""
    return str(pytree.tree_map(lambda t: list(t.shape) if isinstance(t, torch.Tensor) else t, batch))[:200]


def check_metric(args, task):
    """The task's metric, if it has one (common/metrics.py Metric)."""
    metric, scored = getattr(task, "metric", None), callable(getattr(task, "score", None))
    if (metric is not None or scored) and not (
        scored and isinstance(metric, tuple) and len(metric) == 2 and metric[1] in ("higher", "lower")
    ):
        stop(f'error: --task {args.task}: a metric is `metric = (name, "higher" or "lower")` with a function '
             "score(output, target) that sums it over a batch: it defines one without the other, or another kind")  # fmt: skip
    if metric is not None and metric[0] in ("loss", ""):  # metrics.csv: test_<name> beside test_loss
        stop(f"error: --task {args.task}: a metric named {metric[0]!r} would take the loss's columns in metrics.csv "
             '(test_loss): name it after what score() sums, e.g. `metric = ("mae", "lower")`')  # fmt: skip


def check_weights(args, task):
    """The task's `weights(args)` file, which rank 0 alone reads (meta.load_whole()): checked there against what
    it declares, headers only, before it is trusted; a FIFO blocked rank 0 for ever, a file cut short was torch's
    "central directory" error naming no file. Every rank ends with rank 0's verdict. Stage 05 alone has
    --full-shard, and reads the file."""
    if not (hasattr(args, "full_shard") and getattr(task, "weights", None)):
        return
    path, problem = is_rank0() and task.weights(args), None
    path = path and Path(path)
    if path and not path.is_file():
        problem = "does not exist" if not path.exists() else "is not a regular file (a FIFO, a socket or a device)"
    elif path:
        try:
            torch_file(path)
            found = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped: no copy read
        except (Refused, OSError) as err:
            problem = f"is damaged or no file torch.save wrote ({str(err).removeprefix(str(path)).lstrip(': ')})"
        except Exception as err:  # a pickle weights_only refuses: it may be planted
            problem = f"cannot be loaded with weights_only=True ({type(err).__name__})"
        else:
            if not (isinstance(found, dict) and found and all(torch.is_tensor(v) for v in found.values())):
                problem = "holds no state dict, names of tensors (a training checkpoint? --save-model writes one)"
    box = [problem and f"error: --task {args.task}: its weights(args) file {path} {problem}: give a torch.save'd "
                       "state dict of the task's model"]  # fmt: skip
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    if box[0]:
        stop(box[0])


def check_collate(args, task, name, samples):
    """The first samples of a data set, batched as training will: one line naming the shapes, not a traceback."""
    collate, what = (task.collate, "its collate()") if hasattr(task, "collate") else (default_collate, "stacking")
    try:
        batch = collate(samples)
    except Exception as err:  # the user's samples or collate: anything can fail here
        fix = "" if hasattr(task, "collate") else ": define collate(samples) in the task to pad them (README)"
        stop(f"error: --task {args.task}: {what} fails on the first samples of its {name} set, of shapes "
             f"{shapes(samples)} ({type(err).__name__}: {str(err)[:150]}){fix}")  # fmt: skip
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        stop(f"error: --task {args.task}: {what} must return a pair (inputs, labels), each a tensor or a dict, list or "
             f"tuple of them; of its {name} set's first samples it returns {shapes(batch)}")  # fmt: skip
    if count(batch[1]) != len(samples):  # flattened labels: an evaluation would count tokens as samples
        stop(f"error: --task {args.task}: {what} of {len(samples)} samples of its {name} set returns labels of "
             f"shapes {shapes(batch[1])}: the stages count a batch's samples by its labels' first dimension (each "
             "test sample once, images/s): keep it the batch's, and flatten in loss() and score()")  # fmt: skip


def check_counts(epoch, sums, sizes, dry_run):
    """The epoch's all-reduced sums (metrics.Epoch) count every sample of its sets: training at least once (a
    rank's share is padded to one length), each evaluation exactly once. A loader that ended early (its data
    set's __len__ counting more than it serves, a StopIteration) is one line, not an epoch logged as whole."""
    for (name, part), size in zip(sums._asdict().items(), sizes, strict=True):
        if size < 2**24 and (part.samples < size if name == "training" else part.samples != size):  # float32: exact
            if name != "training" or not dry_run:
                stop(f"error: epoch {epoch}'s {name} counted {int(part.samples)} of its {size} samples: its loader "
                     "ended early (a data set whose __len__ counts more items than it serves?)")  # fmt: skip


def explain(err, task):
    """One line for a label outside the model's outputs, or a collate() that failed on a later batch; else None.
    Said by the rank that met it: the others may have had no such label or batch."""
    frames = [frame for frame, _ in traceback_frames(err)]
    outside = re.search(r"Target (-?\d+) is out of bounds", str(err))
    losses = [f.f_locals["input"] for f in frames if f.f_code.co_name in ("cross_entropy", "nll_loss")]
    if outside and losses and torch.is_tensor(losses[0]) and losses[0].ndim > 1:
        count = losses[0].shape[1]
        return (f"error: --task {task}: a label {outside[1]}, but the model has {count} outputs (labels 0 to "
                f"{count - 1}): give model(args) one output per class, or labels in that range")  # fmt: skip
    targets = [f.f_locals.get("target") for f in frames if f.f_code.co_name in ("cross_entropy", "nll_loss")]
    if "target" in str(err) and targets and torch.is_tensor(targets[0]) and targets[0].ndim > 1:  # [B, 1] labels
        return (
            f"error: --task {task}: a batch of labels of shape {list(targets[0].shape)}, but the loss takes one class "
            "index per sample (shape [B]): return each label as an int (label.squeeze(), label.item())"
        )
    if "Expected more than 1 value per channel when training" in str(err):  # BatchNorm, a batch of one sample
        return (f"error: --task {task}: a training batch of one sample reached BatchNorm, which needs two to "
                "normalize: choose a --batch-size (per rank) that leaves no last batch of one, or --limit the set")  # fmt: skip
    collates = [f for f in frames if "collate" in f.f_code.co_name]
    if collates:
        code = collates[0].f_code
        samples = collates[0].f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        return (f"error: --task {task}: batching samples of shapes {shapes(samples)} failed ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:150]}): define (or fix) collate(samples) in the task (README)")  # fmt: skip
    if "in DataLoader worker" in str(err) and "collate" in str(err):  # the worker's traceback, as text
        return (f"error: --task {task}: batching samples failed in a DataLoader worker ({str(err).splitlines()[-1][:150]}): "
                "--num-workers 0 names their shapes; define (or fix) collate(samples) in the task (README)")  # fmt: skip
    return None


def traceback_frames(err):
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
