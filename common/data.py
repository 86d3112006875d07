"""The data sets (--dataset) from --data-dir, decoded once into tensors, and the loaders every stage
uses (--loader):

  batched  (default) the data set is one uint8 tensor; each batch is one indexing operation, pinned
           and copied to the GPU asynchronously: no PIL image, no per-sample Python
  classic  pytorch/examples' pipeline: one PIL image per sample through ToTensor and Normalize,
           as torchvision's data sets make them, collated per batch; what `make profile` shows
  device   the whole (small) data set in GPU memory: batches are drawn there, nothing is copied

All three follow the sampler they are given: a DistributedSampler shards each alike. The sets are
in torchvision's layout on disk (`synthetic`: random images made in memory, for benchmarks); the
stages never download: `make data DATASET=...` (tools/prepare_data.py) prepares a folder once.
"""

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image
from torch.utils import _pytree as pytree  # nested dicts, lists and tuples, as torch.compile walks
from torch.utils.data import BatchSampler, DataLoader, Dataset, Subset, default_collate

from common import datafiles, sampling
from common.environment import cpus_per_rank

FILES = {  # MNIST's sha256 of the uncompressed IDX files
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


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

    def subset(self, indices):
        """The images at `indices`, in tensors of their own."""
        images, labels = self.images[indices], self.labels[indices]
        return Images(self.name, images, labels, self.mean, self.std, self.classes)


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
            f"{name} is not in {folder} (missing {missing[0]}): run `make data DATASET={name}` on "
            f"a machine with internet access (the login node), or point --data-dir at a folder "
            f"holding {spec.folder}/"
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
    "mnist": Spec("MNIST/raw", [*FILES], (0.1307,), (0.3081,), 10, 28, "MNIST"),
    "fashion-mnist": Spec("FashionMNIST/raw", [*FILES], (0.286,), (0.353,), 10, 28, "FashionMNIST"),
    "cifar10": Spec("cifar-10-batches-py", CIFAR10_FILES, (0.4914, 0.4822, 0.4465),
                    (0.2470, 0.2435, 0.2616), 10, 32, "CIFAR10", cifar_batches),
    "cifar100": Spec("cifar-100-python", ["train", "test"], (0.5071, 0.4865, 0.4409),
                     (0.2673, 0.2564, 0.2762), 100, 32, "CIFAR100", cifar_batches),
    "synthetic": Spec("", [], (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 10, 32, read=made),
}  # fmt: skip


def split(dataset, fraction, seed):
    """(training part, validation part): `fraction` of the images, drawn with `seed`, held out for
    validation, both in the order of `dataset`. For 0 the validation part is empty."""
    subset = dataset.subset if type(dataset) is Images else lambda i: Subset(dataset, i.tolist())
    if not fraction:
        return dataset, subset(torch.tensor([], dtype=torch.long))
    held = round(len(dataset) * fraction)
    if not 0 < held < len(dataset):
        raise ValueError(f"a validation fraction of {fraction} of {len(dataset)} images leaves a "
                         "part empty")  # fmt: skip
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return subset(order[held:].sort().values), subset(order[:held].sort().values)


class PerSample(Dataset):
    """What torchvision's data sets do per sample: a PIL image of the decoded array, ToTensor and
    Normalize. The DataLoader collates the samples into batches."""

    def __init__(self, dataset):
        from torchvision import transforms as T  # here: it doubles the time `import torch` takes

        self.images, self.labels = dataset.images, dataset.labels
        self.transform = T.Compose([T.ToTensor(), T.Normalize(dataset.mean, dataset.std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].permute(1, 2, 0).squeeze(2).numpy()  # H x W x C, or H x W
        return self.transform(Image.fromarray(image)), int(self.labels[index])


class OnDevice:
    """The whole data set in device memory, batched in the sampler's order of each epoch."""

    def __init__(self, dataset, sampler, batch_size, device):
        # normalized on the CPU, as the batched loader does: the same floats on any device
        self.images = normalize(dataset.images, dataset.mean, dataset.std).to(device)
        self.labels = dataset.labels.to(device)
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        # one copy per epoch
        order = torch.tensor(list(self.sampler), dtype=torch.long, device=self.images.device)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            yield self.images[batch], self.labels[batch]


def num_workers(args, per_sample, env=os.environ):
    """--num-workers, else for a pipeline per sample (classic, or a task's data set) the rank's CPUs
    but one; none for the batched one: a batch is one indexing, cheaper than a worker's handing."""
    if args.loader == "device":
        return 0
    if args.num_workers is None and per_sample:
        return cpus_per_rank(env) - 1
    return args.num_workers or 0


def loader(dataset, sampler, batch_size, args, device, collate=None):
    """Batches of `dataset` in the order of `sampler`, by the pipeline --loader names; a data set
    read sample by sample is batched by `collate` (the task's: padding, masks), else stacked."""
    if args.loader == "device":
        return OnDevice(dataset, sampler, batch_size, device)
    per_sample = args.loader == "classic" or not isinstance(dataset, Images)  # one at a time
    workers = num_workers(args, per_sample)
    # pinned (page-locked) batches: the copy to the GPU can be asynchronous. Worker seeds from a
    # generator of their own, seeded by --seed: the global one, which checkpoints save, then
    # advances the same in a resumed run
    generator = torch.Generator().manual_seed(args.seed)
    options = dict(num_workers=workers, pin_memory=device.type == "cuda",
                   persistent_workers=workers > 0, generator=generator)  # fmt: skip
    if isinstance(dataset, Images) and per_sample:  # classic
        dataset = PerSample(dataset)
        return DataLoader(dataset, batch_size, sampler=sampler, collate_fn=collate, **options)
    if not isinstance(dataset, Images):  # a task's own: samples and batches draw their own numbers
        dataset = sampling.Seeded(dataset, args.seed, collate or default_collate)
        sampler = sampling.Tagged(sampler)
    # the sampler's indices come in lists of batch_size, and the dataset builds each batch
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    return DataLoader(dataset, sampler=batches, batch_size=None, **options)


def to_device(batch, device):
    """`batch` on `device`: a tensor, or those in nested dicts, lists and tuples (a collate's)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


def count(batch):
    """The samples in `batch`: the length of its first tensor (a label, or one of a dict's)."""
    return next((len(t) for t in pytree.tree_leaves(batch) if torch.is_tensor(t)), len(batch))


def first(batch, n):
    """The first `n` samples of every tensor in `batch`; a 0-dim tensor has none: kept."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:n] if t.ndim else t, batch)


def chunk(batch, parts):
    """`batch` in at most `parts` slices of samples, each nested as `batch` is (--grad-accum)."""
    slices = len(next(t for t in pytree.tree_leaves(batch) if torch.is_tensor(t)).chunk(parts))
    return [pytree.tree_map_only(torch.Tensor, lambda t, i=i: t.chunk(parts)[i], batch)
            for i in range(slices)]  # fmt: skip
