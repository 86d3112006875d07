"""Guard rail: a task's samples and batches, named in one line where they do not fit: a collate() that fails
(with the shapes it was given), a batch that is no (input, label) pair, a label the model has no output for, an
epoch that counted fewer samples than its sets hold (its weights: pretrained.py)."""

import math

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from common.data import Images, count, to_device
from common.guards.divergence import finite
from common.guards.ending import stop
from common.guards.randomness import generators, set_generators
from common.options.loaders import Seeded, seed


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
    if scalars := [t for t in pytree.tree_leaves(batch[1]) if torch.is_tensor(t) and t.ndim == 0]:  # ntokens
        stop(
            f"error: --task {args.task}: {what} returns labels holding a 0-dim tensor ({scalars[0]}): the stages "
            "cut a batch per sample (an evaluation's padding, --grad-accum), which a batch's number would outlive: "
            "compute it in loss() from the labels"
        )
    if count(batch[1]) != len(samples):  # flattened labels: an evaluation would count tokens as samples
        stop(
            f"error: --task {args.task}: {what} of {len(samples)} samples of its {name} set returns labels of "
            f"shapes {shapes(batch[1])}: the stages count a batch's samples by its labels' first dimension (each "
            "test sample once, images/s): keep it the batch's, and flatten in loss() and score()"
        )
    if name == "test" and hasattr(task, "collate") and draws(task.collate, samples):  # a random masking
        stop(
            f"error: --task {args.task}: its collate() draws random numbers (on the same samples it returns other "
            "batches): a test batch's draws follow its first sample, so the test numbers would change with "
            "--test-batch-size and the world size; draw in the data set's __getitem__, which is seeded per sample"
        )


def draws(collate, samples):
    """Does `collate` draw: does it batch the same samples otherwise under other seeds? The run's generators are
    put back after."""
    before, batches = generators(), []
    try:
        for key in ("one", "other"):
            seed("collate", key)
            batches.append(pytree.tree_leaves(collate(samples)))
    finally:
        set_generators(before)
    one, other = batches
    if len(one) != len(other):
        return True
    return not all(
        torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else repr(a) == repr(b)
        for a, b in zip(one, other, strict=True)
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


def first_batch(dataset, task):
    """Two training samples batched as training batches them (Images: indexed by a list), the run's generators
    kept: what check_mean() runs the task's loss() on."""
    if isinstance(dataset, Images):
        return dataset[[0, min(1, len(dataset) - 1)]]
    samples = Seeded(dataset, 0, list)[[(i, 0) for i in range(min(len(dataset), 2))]]
    return getattr(task, "collate", default_collate)(samples)


def check_mean(model, loss, batch, task):
    """A task's loss() is the mean over the batch's samples: the stages weigh each batch's by its samples, and DDP
    averages the ranks' gradients. A sum (reduction="sum") made every number follow the batch and the world size
    (stage 03 at 2 ranks: a test loss of 197 where stage 01 said 77), unsaid. Told on two training samples, then on
    the same two twice: a mean stays, a sum doubles. The model's mode and the run's generators are left as they
    were (every rank runs it: a forward of DDP or FSDP is collective)."""
    x, y = to_device(batch, next(model.parameters()).device)

    def twice(tree):  # each sample twice; a number beside the batch (an auxiliary loss) once
        return pytree.tree_map_only(torch.Tensor, lambda t: torch.cat([t, t]) if t.ndim else t, tree)

    training, before = model.training, generators()
    try:
        with torch.no_grad():
            output = model.eval()(x)
            check_batch_first(output, count(y), task)
            once, doubled = float(loss(output, y)), float(loss(twice(output), twice(y)))
    finally:
        model.train(training)
        set_generators(before)
    if math.isfinite(once) and once and abs(doubled / once - 2) < 1e-3:
        stop(
            f"error: --task {task}: its loss() sums over the batch ({once:.4g} on two samples, {doubled:.4g} on the "
            "same twice): the stages take it as the mean over the batch's samples (the logged losses, the gradients' "
            'scale and DDP\'s average follow it): return the mean (reduction="mean", or divide by the samples)'
        )


def check_batch_first(output, samples, task):
    """Each tensor of a model's output is a row per sample (an evaluation keeps a rank's own rows, the padding after
    them cut: common/data.py first()), or 0-dim. Another, beside the batch (a load per expert, a class's weights),
    was cut to the batch's size too: a test loss of 1.56 for 2.20, a class said missing from a model of 10."""
    wide = [tuple(t.shape) for t in pytree.tree_leaves(output) if torch.is_tensor(t) and t.ndim and len(t) != samples]
    if wide:
        stop(
            f"error: --task {task}: model(args) returns a tensor of shape {list(wide[0])} for {samples} samples: each "
            "tensor it returns must hold a row per sample (batch first), or be 0-dim (a number of the batch, e.g. an "
            "auxiliary loss): the evaluation keeps a rank's own samples' rows; compute the rest in loss()"
        )


def overflows(model, batch):
    """Are the model's outputs on `batch` (two training samples) not finite, its weights finite? A run diverging
    overflows there before in its weights (--lr 1e10); a loss of its own (the default one over no label) does not.
    The model's mode and the run's generators are left as they were (every rank runs it: FSDP's forward is
    collective)."""
    training, before = model.training, generators()
    try:
        with torch.no_grad():
            output = model.eval()(to_device(batch, next(model.parameters()).device)[0])
    finally:
        model.train(training)
        set_generators(before)
    return not finite(output)
