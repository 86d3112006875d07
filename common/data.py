"""The data sets (--dataset) from --data-dir, decoded once into tensors, and the loader every stage
uses by default: the data set is one uint8 tensor; each batch is one indexing operation, pinned
and copied to the GPU asynchronously: no PIL image, no per-sample Python. It follows the sampler
it is given: a DistributedSampler shards it. The sets are in torchvision's layout on disk
(`synthetic`: random images made in memory, for benchmarks); the stages never download: `make data
DATASET=...` (tools/prepare_data.py) prepares a folder once. Other pipelines (--loader, workers,
a task's own data set): common/options/loaders.py.
"""

import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree  # nested dicts, lists and tuples, as torch.compile walks
from torch.utils.data import BatchSampler, DataLoader, Dataset

from common import datafiles

IDX = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]  # MNIST's files, and Fashion-MNIST's


class Images(Dataset):
    """A data set as one uint8 tensor N x C x H x W and its int64 labels. Indexed with a list, it
    returns a normalized batch: one tensor operation instead of 64 PIL images and a collate."""

    def __init__(self, name, images, labels, mean, std, classes):
        self.name, self.images, self.labels = name, images, labels
        self.mean, self.std, self.classes = tuple(mean), tuple(std), classes
        self.in_channels, self.image_size = images.shape[1], images.shape[-1]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices, dtype=torch.long)
        return normalize(self.images[indices], self.mean, self.std), self.labels[indices]


class Shard(NamedTuple):
    indices: list  # the samples to evaluate, in order: this rank's own, then the padding
    samples: int  # how many of them are this rank's own


def shard(count, rank, world_size):
    """This rank's `count` evaluation samples: every world_size-th index from `rank`, padded with
    sample 0 to one length on every rank, so all run as many forwards (under FSDP, collectives: one
    more would wait forever); the evaluation counts the first `samples` alone: each once."""
    indices = list(range(rank, count, world_size))
    return Shard(indices + [0] * (math.ceil(count / world_size) - len(indices)), len(indices))


def normalize(images, mean, std):
    """uint8 N x C x H x W -> float, on the images' device, as ToTensor() and Normalize() do."""
    mean = torch.tensor(mean, device=images.device).view(-1, 1, 1)
    std = torch.tensor(std, device=images.device).view(-1, 1, 1)
    return images.float().div_(255).sub_(mean).div_(std)


def dataset(data_dir, name, train, limit=None):
    """The training (or test) set `name` of SETS, read from data_dir, its first `limit` images if
    given; a FileNotFoundError saying what to do if it is not there."""
    spec = SETS[name]
    folder = Path(data_dir) / spec.folder
    missing = [file for file in spec.files if not (folder / file).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{name} is not in {folder} (missing {missing[0]}): run `python tools/prepare_data.py "
            f"{data_dir} {name}` (it downloads all but MNIST: on the login node), or point "
            f"--data-dir at a folder holding {spec.folder}/"
        )
    if spec.read is None:  # MNIST's IDX files (and Fashion-MNIST's)
        prefix = "train" if train else "t10k"
        images = datafiles.read_idx(folder / f"{prefix}-images-idx3-ubyte", 3).unsqueeze(1)
        labels = datafiles.read_idx(folder / f"{prefix}-labels-idx1-ubyte", 1).long()
    else:  # CIFAR's batches, or images made in memory
        images, labels = spec.read(folder, train, spec, name)
    return Images(name, images[:limit], labels[:limit], spec.mean, spec.std, spec.classes)


def synthetic(count, classes, seed):
    """Random 3 x 32 x 32 images and labels, the same per seed: for benchmarks, nothing to learn"""
    generator = torch.Generator().manual_seed(seed)
    # eight pixels per 64-bit draw over the whole int64 range: 4x faster than one draw per pixel
    pixels = torch.empty(count * 3 * 32 * 32 // 8, dtype=torch.int64)
    pixels.random_(-(2**63), None, generator=generator)
    labels = torch.randint(classes, (count,), generator=generator)
    return pixels.view(torch.uint8).view(count, 3, 32, 32), labels


def cifar_batches(folder, train, spec, name):
    """CIFAR's python batches, not torchvision's CIFAR classes: they refuse all but the official."""
    paths = [folder / file for file in (spec.files[:-1] if train else spec.files[-1:])]
    key = b"labels" if name == "cifar10" else b"fine_labels"
    return datafiles.read_cifar(paths, key)


def made(folder, train, spec, name):
    """`synthetic`: as many images as CIFAR has, made in memory."""
    return synthetic(50_000 if train else 10_000, spec.classes, seed=int(train))


class Spec(NamedTuple):
    folder: str  # under --data-dir, as torchvision lays it out
    files: list  # what must be there; for CIFAR, the last one is the test set
    mean: tuple  # per-channel pixel statistics of the training set, for Normalize
    std: tuple
    classes: int
    size: int  # height and width of an image; its channels: one per mean
    download: str = None  # the name of torchvision's class that downloads the set
    read: Callable = None  # (folder, train, spec, name) -> uint8 images N x C x H x W, labels


CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
SETS = {
    "mnist": Spec("MNIST/raw", IDX, (0.1307,), (0.3081,), 10, 28, "MNIST"),
    "fashion-mnist": Spec("FashionMNIST/raw", IDX, (0.286,), (0.353,), 10, 28, "FashionMNIST"),
    "cifar10": Spec(
        "cifar-10-batches-py",
        CIFAR10_FILES,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        10,
        32,
        "CIFAR10",
        cifar_batches,
    ),
    "cifar100": Spec(
        "cifar-100-python",
        ["train", "test"],
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
        100,
        32,
        "CIFAR100",
        cifar_batches,
    ),
    "synthetic": Spec("", [], (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 10, 32, read=made),
}


def batched(dataset, args):
    """Does the default loader read `dataset`: Images, --loader batched and no worker? Else the
    option's (common/options/loaders.py)."""
    return isinstance(dataset, Images) and args.loader == "batched" and not args.num_workers


def loader(dataset, sampler, batch_size, device):
    """Batches of `dataset` (Images) in the order of `sampler`: its indices come in lists of
    batch_size, each batch one indexing; pinned (page-locked), so that the copy to the GPU can be
    asynchronous. A generator of its own: each epoch draws a seed from it, which from the global
    one would shift every dropout mask after it."""
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    pinned, own = device.type == "cuda", torch.Generator()
    return DataLoader(dataset, sampler=batches, batch_size=None, pin_memory=pinned, generator=own)


def to_device(batch, device):
    """`batch` on `device`: a tensor, or those in nested dicts, lists and tuples (a collate's)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


def count(batch):
    """The samples in `batch`: the length of its first tensor (a label, or one of a dict's)."""
    return next((len(t) for t in pytree.tree_leaves(batch) if torch.is_tensor(t)), len(batch))


def first(batch, n):
    """The first `n` samples of every tensor in `batch`; a 0-dim tensor has none: kept."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:n] if t.ndim else t, batch)
