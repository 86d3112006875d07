"""The data sets (--dataset) from --data-dir, decoded once into tensors, and the loaders every stage
uses (--loader):

  batched  (default) the data set is one uint8 tensor; each batch is one indexing operation, pinned
           and copied to the GPU asynchronously: no PIL image, no per-sample Python
  classic  pytorch/examples' pipeline: one PIL image per sample through ToTensor and Normalize, as
           torchvision's data sets make them, collated per batch; the reference that `make profile` shows
  device   the whole (small) data set in GPU memory: batches are drawn there, nothing is copied

All three follow the sampler they are given, so a DistributedSampler shards each of them the same
way. The data sets are in torchvision's on-disk layout; `synthetic` is random images made in memory,
for benchmarks. The training scripts never download: `make data DATASET=...` (tools/prepare_data.py)
prepares the folder once. Every file is checked as it is read (common/datafiles.py).
"""

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image
from torch.utils import _pytree as pytree  # nested dicts, lists and tuples: the same walk as torch.compile's
from torch.utils.data import BatchSampler, DataLoader, Dataset, Subset

from common import datafiles, sampling
from common.environment import cpus_per_rank

FILES = {  # MNIST's sha256 of the uncompressed IDX files
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


class Images(Dataset):
    """A data set as one uint8 tensor N x C x H x W and its int64 labels. Indexed with a list of
    indices it returns a whole normalized batch, so a batch costs one tensor operation instead of 64
    PIL images and a collate."""

    def __init__(self, name, images, labels, mean, std, classes):
        self.name, self.images, self.labels = name, images, labels
        self.mean, self.std, self.classes = tuple(mean), tuple(std), classes
        self.in_channels, self.image_size = images.shape[1], images.shape[-1]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices, dtype=torch.long)
        return normalize(self.images[indices], self.mean, self.std), self.labels[indices]

    def subset(self, indices):
        """The images at `indices`, in tensors of their own."""
        return Images(self.name, self.images[indices], self.labels[indices], self.mean, self.std, self.classes)


class Shard(NamedTuple):
    indices: list  # the samples to evaluate, in order: this rank's own, then the padding
    samples: int  # how many of them are this rank's own


def shard(count, rank, world_size):
    """This rank's share of `count` evaluation samples: every world_size-th index from `rank`, padded to the same
    length on every rank (with the first sample again, which any data set has). Every rank then runs the same
    number of forward passes (under FSDP each one is a collective: a rank with one batch more would wait for a
    partner forever), and the evaluation counts the first `samples` alone: each sample exactly once."""
    indices = list(range(rank, count, world_size))
    return Shard(indices + [0] * (math.ceil(count / world_size) - len(indices)), len(indices))


def normalize(images, mean, std):
    """uint8 N x C x H x W -> float, on the images' device, as ToTensor() and Normalize(mean, std) make it."""
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
            f"{name} is not in {folder} (missing {missing[0]}): run `make data DATASET={name}` on a machine "
            f"with internet access (the login node), or point --data-dir at a folder holding {spec.folder}/"
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
    pixels = torch.empty(count * 3 * 32 * 32 // 8, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    labels = torch.randint(classes, (count,), generator=generator)
    return pixels.view(torch.uint8).view(count, 3, 32, 32), labels


def cifar_batches(folder, train, spec, name):
    """CIFAR's python batches; not torchvision's CIFAR classes: they check the official files'
    MD5s and refuse any other."""
    paths = [folder / file for file in (spec.files[:-1] if train else spec.files[-1:])]
    key = b"labels" if name == "cifar10" else b"fine_labels"
    return datafiles.read_cifar(paths, key)


def made(folder, train, spec, name):
    """`synthetic`: as many images as CIFAR has, made in memory."""
    return synthetic(SYNTHETIC[train], spec.classes, seed=int(train))


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
    # as in pytorch/examples
    "mnist": Spec("MNIST/raw", list(FILES), (0.1307,), (0.3081,), 10, 28, "MNIST"),
    "fashion-mnist": Spec("FashionMNIST/raw", list(FILES), (0.2860,), (0.3530,), 10, 28, "FashionMNIST"),
    "cifar10": Spec("cifar-10-batches-py", CIFAR10_FILES, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 10, 32, "CIFAR10", cifar_batches),
    "cifar100": Spec("cifar-100-python", ["train", "test"], (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 100, 32, "CIFAR100", cifar_batches),
    "synthetic": Spec("", [], (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 10, 32, read=made),
}  # fmt: skip
SYNTHETIC = {True: 50_000, False: 10_000}  # images of 3 x 32 x 32, as many as in CIFAR


def split(dataset, fraction, seed):
    """(training part, validation part): `fraction` of the images, drawn with `seed`, held out for validation,
    both in the order of `dataset`. For 0 the validation part is empty: the stages evaluate it all the same."""
    subset = getattr(dataset, "subset", lambda indices: Subset(dataset, indices.tolist()))  # Images: in tensors
    if not fraction:
        return dataset, subset(torch.tensor([], dtype=torch.long))
    held = round(len(dataset) * fraction)
    if not 0 < held < len(dataset):
        raise ValueError(f"a validation fraction of {fraction} of {len(dataset)} images leaves a part empty")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return subset(order[held:].sort().values), subset(order[:held].sort().values)


class PerSample(Dataset):
    """What torchvision's data sets do per sample: a PIL image of the decoded array, ToTensor and Normalize.
    The DataLoader collates the samples into batches."""

    def __init__(self, dataset):
        from torchvision import transforms  # here: it doubles the time `import torch` takes, for every loader

        self.images, self.labels = dataset.images, dataset.labels
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(dataset.mean, dataset.std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].permute(1, 2, 0).squeeze(2).numpy()  # H x W x C, or grey H x W, as PIL reads
        return self.transform(Image.fromarray(image)), int(self.labels[index])


class OnDevice:
    """The whole data set in device memory, batched in the sampler's order of each epoch."""

    def __init__(self, dataset, sampler, batch_size, device):
        # normalized on the CPU, as the batched loader does: the same floats to the last bit on any device
        self.images = normalize(dataset.images, dataset.mean, dataset.std).to(device)
        self.labels = dataset.labels.to(device)
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        order = torch.tensor(list(self.sampler), dtype=torch.long, device=self.images.device)  # one copy per epoch
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            yield self.images[batch], self.labels[batch]


def num_workers(args, per_sample, env=os.environ):
    """The DataLoader workers of each rank: --num-workers, else for a pipeline per sample (classic, or a data set
    not in tensors) the CPUs of this rank but one for the process itself, and none for the batched one, where a
    batch is one indexing operation and passing it from a worker costs more."""
    if args.loader == "device":
        return 0
    return cpus_per_rank(env) - 1 if args.num_workers is None and per_sample else args.num_workers or 0


def loader(dataset, sampler, batch_size, args, device, collate=None):
    """Batches of `dataset` in the order of `sampler`, by the pipeline --loader names; a data set read sample by
    sample is batched by `collate(samples)` (the task's: padding, masks), else by stacking."""
    if args.loader == "device":
        return OnDevice(dataset, sampler, batch_size, device)
    if not isinstance(dataset, Images):  # a task's own: each sample draws random numbers of its own
        dataset, sampler = sampling.Seeded(dataset, args.seed), sampling.Tagged(sampler)
    per_sample = args.loader == "classic" or not isinstance(dataset, Images)  # one at a time
    workers = num_workers(args, per_sample)
    # pinned (page-locked) batches: the copy to the GPU can be asynchronous. Worker seeds from a generator of their
    # own, seeded by --seed: the global RNG, which checkpoints save, then advances the same in a resumed run
    options = dict(num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                   generator=torch.Generator().manual_seed(args.seed))  # fmt: skip
    if per_sample:
        dataset = PerSample(dataset) if isinstance(dataset, Images) else dataset
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, **options)
    # batched: the sampler's indices come in lists of batch_size, and the dataset builds each batch
    return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None, **options)


def to_device(batch, device):
    """`batch` on `device`: a tensor, or the tensors in nested dicts, lists and tuples (what a collate returns)."""
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def count(batch):
    """The samples in `batch`: the first dimension of its first tensor (of a label, or of a dict of them)."""
    return next((len(t) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)), len(batch))


def first(batch, n):
    """The first `n` samples of every tensor in `batch`."""
    return pytree.tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) else t, batch)


def chunk(batch, parts):
    """`batch` in at most `parts` slices of samples, each as nested as `batch` (stage 05's micro-batches)."""
    leaves, spec = pytree.tree_flatten(batch)
    pieces = [t.chunk(parts) if isinstance(t, torch.Tensor) else None for t in leaves]
    slices = len(next(p for p in pieces if p is not None))
    return [pytree.tree_unflatten([leaf if p is None else p[i] for leaf, p in zip(leaves, pieces, strict=True)], spec)
            for i in range(slices)]  # fmt: skip
