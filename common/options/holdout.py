"""--val-fraction (split()): part of the training set held out, evaluated each epoch beside the
test set, so that a choice of options (--target, the epochs, a learning rate) is not made on the
test set; and --target with --patience (reached()): stop once the last evaluations reach a value
of the task's metric, the validation's where there is one, else the test's. The held-out part is
the training set's samples as the task returns them: a task that augments its training set
(common/tasks/augmented.py) is validated on augmented samples, each drawn the same every epoch.
"""

import torch
from torch.utils.data import Subset

from common.data import Images
from common.distributed import print0


def split(dataset, fraction, seed):
    """(training part, validation part): `fraction` of the images, drawn with `seed`, held out for
    validation, both in the order of `dataset`."""
    subset = (
        (lambda i: images(dataset, i))
        if type(dataset) is Images
        else lambda i: Subset(dataset, i.tolist())
    )
    held = round(len(dataset) * fraction)
    if not 0 < held < len(dataset):
        raise ValueError(
            f"a validation fraction of {fraction} of {len(dataset)} images leaves a part empty"
        )
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return subset(order[held:].sort().values), subset(order[:held].sort().values)


def images(dataset, indices):
    """The Images at `indices`, in tensors of their own: still read a batch at a time."""
    images, labels = dataset.images[indices], dataset.labels[indices]
    return Images(dataset.name, images, labels, dataset.mean, dataset.std, dataset.classes)


def unreachable(name, target):
    """Why `target` on the metric `name` is not what it says, or None: accuracy is in %, and a
    fraction (0.99) is reached at once (tools/scaling.py's --target too)."""
    if name != "accuracy" or 1 < target <= 100:
        return None
    hint = "never reached" if target > 100 else "reached at once"
    hint += f" (did you mean {100 * target:g}?)" if 0 < target <= 1 else ""  # a fraction, not in %
    return f"--target {target:g}: accuracy is in %, from 0 to 100: {target:g} % is {hint}"


def reached(log, target, patience):
    """Have the last `patience` evaluations (validation, else test) all reached `target`? Never
    within an epoch resumed part-way: a lower --target after a stop mid-epoch ended the run there,
    its weights exported beside the row of the epoch before."""
    name, better = log.metric.name, log.metric.better
    if problem := unreachable(name, target):
        raise ValueError(problem)
    if any(epoch > log.rows[-1]["epoch"] if log.rows else True for epoch in log.carried):
        return False  # the epoch resumed part-way has yet to end
    split = "val" if log.rows and log.rows[-1][f"val_{name}"] != "" else "test"
    last = [row[f"{split}_{name}"] for row in log.rows[-patience:]]
    if len(last) < patience:
        return False
    if not all(v >= target if better == "higher" else v <= target for v in last):
        return False
    print0(
        f"stopping: the last {patience} evaluations reached --target {target:g} ({name}, "
        f"{better} is better)"
    )
    return True
