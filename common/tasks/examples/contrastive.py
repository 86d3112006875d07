"""Contrastive learning, SimCLR-style: each sample is two noisy views of one point; a small MLP
embeds both, and the loss asks each view to pick its partner among the other views of the whole
global batch, every rank's. loss() gathers the other ranks' embeddings with an all_gather that
keeps the gradient (torch.distributed.nn.functional), so two ranks train as one on the same
global batch (--batch-size); a gather that dropped it would leave each rank's embeddings the
gradient of its own rows alone. Labels are each sample's index (the stages count samples by them).
The metric, alignment, is each sample's cosine similarity of its two views: one value per
sample, no collective (score() runs only where a rank holds samples; loss() on every rank).

    python 01_single_gpu/train.py --task common/tasks/examples/contrastive.py --epochs 2
    torchrun --standalone --nproc_per_node=2 03_ddp_single_node/train.py \
        --task common/tasks/examples/contrastive.py --epochs 2
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_gather
from torch.nn import functional as F
from torch.utils.data import TensorDataset

metric = ("alignment", "higher")
TEMPERATURE = 0.5  # of the similarities: lower sharpens the choice of a partner


def add_arguments(group):
    group.add_argument("--samples", type=int, default=1024, help="training samples (default: 1024)")
    group.add_argument("--features", type=int, default=16, help="inputs per view (default: 16)")


def check(args):
    # --grad-accum (stage 05) gives loss() each micro-batch alone: fewer partners, another loss
    if getattr(args, "grad_accum", 1) > 1:
        return "--grad-accum: this loss compares each view with the batch's: train without it"
    return None


def views(n, args, seed):
    """n points (n, 2, features): two views each, the point plus noise of its own."""
    g = torch.Generator().manual_seed(seed)
    points = torch.randn(n, 1, args.features, generator=g)
    pairs = points + 0.5 * torch.randn(n, 2, args.features, generator=g)
    return TensorDataset(pairs[: args.limit], torch.arange(n)[: args.limit])


def datasets(args):
    return views(args.samples, args, args.seed), views(args.samples // 4, args, args.seed + 1)


def model(args):
    return nn.Sequential(nn.Linear(args.features, 64), nn.ReLU(), nn.Linear(64, 16))


def gathered(z):
    """The global batch: every rank's rows of z in rank order, and where this rank's own start.
    An evaluation's last batch may hold a sample fewer on some ranks, or none: each pads its rows
    to the longest for the all_gather (which needs one shape), and the padding is cut again."""
    if not dist.is_initialized():
        return z, 0
    sizes = [
        torch.zeros(1, dtype=torch.long, device=z.device) for _ in range(dist.get_world_size())
    ]
    dist.all_gather(sizes, torch.tensor([len(z)], device=z.device))
    sizes = [int(size) for size in sizes]
    rows = all_gather(F.pad(z, (0, 0, 0, max(sizes) - len(z))))
    return torch.cat([r[:size] for r, size in zip(rows, sizes, strict=True)]), sum(
        sizes[: dist.get_rank()]
    )


def loss(output, target):
    """Each view of the rank's samples against the other views of the global batch, both ways:
    the mean over the rank's share, which the stages weigh by its samples (training: all equal)."""
    z = F.normalize(output, dim=-1)  # (B, 2, dim)
    first, start = gathered(z[:, 0])
    second, _ = gathered(z[:, 1])
    right = torch.arange(start, start + len(z), device=z.device)
    forward = F.cross_entropy(z[:, 0] @ second.T / TEMPERATURE, right)
    backward = F.cross_entropy(z[:, 1] @ first.T / TEMPERATURE, right)
    return (forward + backward) / 2


def score(output, target):
    return F.cosine_similarity(output[:, 0], output[:, 1], dim=-1)
