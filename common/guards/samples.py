"""Guard rail: a task's samples and batches, named in one line where they do not fit: a collate() that fails
(with the shapes it was given), a batch that is no (input, label) pair, a label the model has no output for, an
epoch that counted fewer samples than its sets hold; and its file of whole weights, checked before stage 05 loads
it."""

import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
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
    totalled = callable(getattr(task, "totals", None)) and callable(getattr(task, "figure", None))
    if (metric is not None or scored or hasattr(task, "totals") or hasattr(task, "figure")) and not (
        scored != totalled and isinstance(metric, tuple) and len(metric) == 2 and metric[1] in ("higher", "lower")
    ):
        stop(
            f'error: --task {args.task}: a metric is `metric = (name, "higher" or "lower")` with either a function '
            "score(output, target) that returns it per sample, shape (B,), or totals(output, target), a row of sums, "
            "and figure(totals) of the epoch's: it defines one without the other, both, or another kind"
        )
    if metric is not None and metric[0] in ("loss", ""):  # metrics.csv: test_<name> beside test_loss
        stop(
            f"error: --task {args.task}: a metric named {metric[0]!r} would take the loss's columns in metrics.csv "
            '(test_loss): name it after what score() sums, e.g. `metric = ("mae", "lower")`'
        )


def check_totals(args, task, sizes):
    """A task's totals(): a row only where a rank has a sample of the split it evaluates, so a split of fewer
    samples than ranks gave rows of two lengths to one all-reduce (gloo aborted, "Received data size doesn't
    match")."""
    ranks, short = dist.get_world_size() if dist.is_initialized() else 1, [n for n in sizes if 0 < n]
    if callable(getattr(task, "totals", None)) and short and min(short) < ranks:
        stop(
            f"error: --task {args.task}: totals() need a sample on every rank: a split of {min(short)} samples at "
            f"{ranks} ranks; give it more samples (--limit, --val-fraction) or use fewer ranks"
        )


def check_weights(args, task):
    """The task's `weights(args)` file, which rank 0 alone reads at stage 05 (hooks.load_weights()): checked there
    against what it declares, headers only, before it is trusted; a FIFO blocked rank 0 for ever, a file cut short
    was torch's "central directory" error naming no file; keys that do not fit model(args) were torch's message, the
    keys elided. Every rank ends with rank 0's verdict. Every stage starts from the file (common/options/hooks.py)."""
    if not getattr(task, "weights", None):
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
            elif misfit := misfits(found, task, args):
                problem = f"does not fit model(args): {misfit}"
    fix = "give a torch.save'd state dict of the task's model"
    if problem and problem.startswith("does not fit") and not problem.endswith("a fault in the values"):
        fix = 'name the keys to leave at their initialisation (a new head) in the task: FRESH = ("fc.",)'
    box = [problem and f"error: --task {args.task}: its weights(args) file {path} {problem}: {fix}"]
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    if box[0]:
        stop(box[0])


class Loads(TorchFunctionMode):
    """Notes a copy of values into a tensor on the meta device, which keeps none: a load_state_dict() lost."""

    def __init__(self):
        super().__init__()
        self.lost = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and args[0].is_meta and not args[1].is_meta:
            self.lost = True
        return func(*args, **(kwargs or {}))


def check_meta_load(args, task):
    """Stage 05 builds model(args) on the meta device (shapes, no values): weights that model(args) loads itself
    (the torchvision idiom) were lost there, and the run trained from a random start, unsaid. One line instead."""
    if not (hasattr(args, "full_shard") and getattr(task, "META", True)):
        return
    loads = Loads()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), loads, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own on a load onto meta: this line says it
            task.model(args)
    except Exception:  # the stage's own build names what fails
        return
    if loads.lost:
        stop(
            f"error: --task {args.task}: model(args) loads weights itself, which stage 05 would lose: it builds the "
            "model on the meta device (shapes, no values) and would train from a random start: return the file from "
            "weights(args) instead (rank 0 maps it, each rank receives its shards), or set META = False in the task"
        )


def misfits(found, task, args):
    """The keys of `found` that do not fit model(args), built on the meta device (shapes alone), but FRESH's: the
    first few missing, unexpected, mis-shaped, integer where the model's are floats, or holding a NaN or an
    infinity, and their counts; None if it fits or cannot be built so."""
    fresh = tuple(getattr(task, "FRESH", ()))
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = task.model(args).state_dict()
    except Exception:  # its own load names what fails
        return None
    want = {k: list(t.shape) for k, t in model.items() if not k.startswith(fresh)}
    got = {k: list(t.shape) for k, t in found.items() if not k.startswith(fresh)}
    kinds = {
        "missing": [k for k in want if k not in got],
        "unexpected": [k for k in got if k not in want],
        "mis-shaped": [
            f"{k} {got[k]} in the file, {want[k]} in the model" for k in want if got.get(k, want[k]) != want[k]
        ],
        # loaded as they are, an integer tensor is rounded into the weights, a NaN trains as a diverged run
        "not floating-point": [
            f"{k} {found[k].dtype}"
            for k in want
            if k in got and model[k].is_floating_point() > found[k].is_floating_point()
        ],
        "not finite": [k for k in want if k in got and found[k].is_floating_point() and not found[k].isfinite().all()],
    }
    said = [
        f"{len(keys)} {kind} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        for kind, keys in kinds.items()
        if keys
    ]
    values = not any(kinds[kind] for kind in ("missing", "unexpected", "mis-shaped"))  # not a new head's
    return "; ".join(said) + (": a fault in the values" if values else "") if said else None


def check_collate(args, task, name, samples):
    """The first samples of a data set, batched as training will: one line naming the shapes, not a traceback."""
    collate, what = (task.collate, "its collate()") if hasattr(task, "collate") else (default_collate, "stacking")
    try:
        batch = collate(samples)
    except Exception as err:  # the user's samples or collate: anything can fail here
        fix = "" if hasattr(task, "collate") else ": define collate(samples) in the task to pad them (README)"
        stop(
            f"error: --task {args.task}: {what} fails on the first samples of its {name} set, of shapes "
            f"{shapes(samples)} ({type(err).__name__}: {str(err)[:150]}){fix}"
        )
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        stop(
            f"error: --task {args.task}: {what} must return a pair (inputs, labels), each a tensor or a dict, list or "
            f"tuple of them; of its {name} set's first samples it returns {shapes(batch)}"
        )
    if count(batch[1]) != len(samples):  # flattened labels: an evaluation would count tokens as samples
        stop(
            f"error: --task {args.task}: {what} of {len(samples)} samples of its {name} set returns labels of "
            f"shapes {shapes(batch[1])}: the stages count a batch's samples by its labels' first dimension (each "
            "test sample once, images/s): keep it the batch's, and flatten in loss() and score()"
        )


def check_counts(epoch, sums, sizes, dry_run):
    """The epoch's all-reduced sums (metrics.Epoch) count every sample of its sets: training at least once (a
    rank's share is padded to one length), each evaluation exactly once. A loader that ended early (its data
    set's __len__ counting more than it serves, a StopIteration) is one line, not an epoch logged as whole."""
    for (name, part), size in zip(sums._asdict().items(), sizes, strict=True):
        if size < 2**24 and (part.samples < size if name == "training" else part.samples != size):  # float32: exact
            if name != "training" or not dry_run:
                stop(
                    f"error: epoch {epoch}'s {name} counted {int(part.samples)} of its {size} samples: its loader "
                    "ended early (a data set whose __len__ counts more items than it serves?)"
                )


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
    collates = [f for f in frames if "collate" in f.f_code.co_name]
    if collates:
        code = collates[0].f_code
        samples = collates[0].f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        return (
            f"error: --task {task}: batching samples of shapes {shapes(samples)} failed ({type(err).__name__}: "
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
