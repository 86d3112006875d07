"""MNIST from --data-dir, decoded once into tensors, and the loaders every stage uses (--loader):

  batched  (default) the data set is one uint8 tensor; each batch is one indexing operation, pinned
           and copied to the GPU asynchronously: no PIL image, no per-sample Python
  classic  pytorch/examples' pipeline: torchvision's MNIST with ToTensor and Normalize, one PIL
           image per sample, collated per batch; the reference that `make profile` shows
  device   the whole (small) data set in GPU memory: batches are drawn there, nothing is copied

All three follow the sampler they are given, so a DistributedSampler shards each of them the same way.
The training scripts never download: compute nodes are often offline, and several ranks must not
write into one folder at once. `make data` (python -m common.data) prepares the folder once.
"""

import gzip
import hashlib
import math
import os
import shutil
import sys
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset
from torchvision import datasets, transforms

MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics, as in pytorch/examples
FILES = {  # sha256 of the uncompressed IDX files
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


class MNIST(Dataset):
    """The images as one uint8 tensor. Indexed with a list of indices it returns a whole batch, so
    a batch costs one tensor operation instead of 64 PIL images and a collate."""

    def __init__(self, data_dir, train):
        raw = Path(data_dir) / "MNIST" / "raw"
        missing = [name for name in FILES if not (raw / name).is_file()]
        if missing:
            raise SystemExit(
                f"error: MNIST is not in {raw} (missing {missing[0]}): run `make data` on a machine "
                "with internet access (the login node), or point --data-dir at a folder holding MNIST/raw/"
            )
        self.data_dir, self.train = data_dir, train
        mnist = datasets.MNIST(data_dir, train=train, download=False)
        self.images, self.labels = mnist.data, mnist.targets

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices)
        return normalize(self.images[indices]), self.labels[indices]


def normalize(images):
    """uint8 N x 28 x 28 -> float N x 1 x 28 x 28, as ToTensor() and Normalize() would make it."""
    return images.unsqueeze(-3).float().div_(255).sub_(MEAN).div_(STD)


class OnDevice:
    """The whole data set in device memory, batched in the sampler's order of each epoch."""

    def __init__(self, dataset, sampler, batch_size, device):
        self.images, self.labels = normalize(dataset.images).to(device), dataset.labels.to(device)
        self.sampler, self.batch_size = sampler, batch_size

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self):
        order = torch.tensor(list(self.sampler), device=self.images.device)  # one copy per epoch
        for batch in order.split(self.batch_size):
            yield self.images[batch], self.labels[batch]


def default_num_workers(env=os.environ):
    """DataLoader workers per process: the CPUs Slurm gave this task (or this process may use), shared
    among the ranks the task runs (torchrun), minus one for the process itself."""
    cpus = int(env.get("SLURM_CPUS_PER_TASK") or len(os.sched_getaffinity(0)))
    return max(cpus // int(env.get("LOCAL_WORLD_SIZE", 1)) - 1, 0)


def loader(dataset, sampler, batch_size, args, device):
    """Batches of `dataset` in the order of `sampler`, by the pipeline --loader names."""
    if args.loader == "device":
        return OnDevice(dataset, sampler, batch_size, device)
    workers = args.num_workers
    if workers is None:  # a batch is one indexing operation: passing it from a worker costs more than it saves
        workers = default_num_workers() if args.loader == "classic" else 0
    options = dict(
        num_workers=workers,
        pin_memory=device.type == "cuda",  # page-locked batches: the copy to the GPU can be asynchronous
        persistent_workers=workers > 0,
        # worker seeds from a generator of their own: the global RNG, which checkpoints save, then
        # advances the same in a resumed run (a new loader) as in an uninterrupted one
        generator=torch.Generator(),
    )
    if args.loader == "classic":
        to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
        classic = datasets.MNIST(dataset.data_dir, train=dataset.train, transform=to_tensor)
        return DataLoader(classic, batch_size=batch_size, sampler=sampler, **options)
    # batched: the sampler's indices come in lists of batch_size, and the dataset builds each batch
    return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None, **options)


def prepare(data_dir):
    """Unpack the vendored .gz files after checking them; download with torchvision only if absent."""
    raw = Path(data_dir) / "MNIST" / "raw"
    if not all((raw / f"{name}.gz").is_file() or (raw / name).is_file() for name in FILES):
        datasets.MNIST(data_dir, train=True, download=True)
        datasets.MNIST(data_dir, train=False, download=True)
    for name, sha256 in FILES.items():
        if not (raw / name).is_file():
            with gzip.open(raw / f"{name}.gz") as src, open(raw / f"{name}.part", "wb") as dst:
                shutil.copyfileobj(src, dst)
            (raw / f"{name}.part").replace(raw / name)
        if hashlib.sha256((raw / name).read_bytes()).hexdigest() != sha256:
            raise SystemExit(f"error: {raw / name} is corrupt (sha256 mismatch): delete it and run `make data` again")
    print(f"MNIST ready in {raw}")


if __name__ == "__main__":
    prepare(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "data")
