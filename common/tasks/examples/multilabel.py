"""Multi-label classification: each sample of --features numbers carries any of --labels tags at
once, a multi-hot float label (B, L). Float labels need a loss() of the task's own (the default
cross-entropy takes class numbers, and says so); its metric is the micro-F1 of the tags it
predicts (a logit above 0) over the whole test set: totals() counts a batch's true positives,
false positives and false negatives, figure() takes F1 of the epoch's counts (a mean of each
sample's F1 is another figure, and a sample with no tags weighs as much as one with five).

    python 01_single_gpu/train.py --task common/tasks/examples/multilabel.py --epochs 2
    torchrun --standalone --nproc_per_node=2 03_ddp_single_node/train.py \
        --task common/tasks/examples/multilabel.py --epochs 2
"""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

metric = ("micro_f1", "higher")


def add_arguments(group):
    group.add_argument("--samples", type=int, default=2000, help="training samples (default: 2000)")
    group.add_argument("--features", type=int, default=16, help="inputs per sample (default: 16)")
    group.add_argument("--labels", type=int, default=5, help="tags to tell (default: 5)")


def data(n, args, seed):
    """A tag is on where its own random direction of the features is positive."""
    directions = torch.randn(args.features, args.labels, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, args.features, generator=torch.Generator().manual_seed(seed))
    return x[: args.limit], (x @ directions > 0).float()[: args.limit]


def datasets(args):
    train = data(args.samples, args, args.seed)
    return TensorDataset(*train), TensorDataset(*data(args.samples // 5, args, args.seed + 1))


def model(args):
    return nn.Sequential(nn.Linear(args.features, 64), nn.ReLU(), nn.Linear(64, args.labels))


def loss(output, target):
    return F.binary_cross_entropy_with_logits(output, target)


def totals(output, target):
    predicted = (output > 0).float()
    hits = (predicted * target).sum()
    return torch.stack([hits, predicted.sum() - hits, target.sum() - hits])  # TP, FP, FN


def figure(totals):
    tp, fp, fn = totals
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else torch.tensor(1.0)  # no tags: all right
