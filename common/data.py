"""MNIST from --data-dir, decoded once into tensors, and the loader every stage uses.

The training scripts never download: compute nodes are often offline, and several ranks must not
write into one folder at once. `make data` (python -m common.data) prepares the folder once.
"""

import gzip
import hashlib
import shutil
import sys
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset
from torchvision import datasets

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
        mnist = datasets.MNIST(data_dir, train=train, download=False)
        self.images, self.labels = mnist.data, mnist.targets

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices)
        x = self.images[indices].unsqueeze(-3).float().div_(255).sub_(MEAN).div_(STD)
        return x, self.labels[indices]


def loader(dataset, sampler, batch_size, num_workers, device):
    """Batches of `dataset` in the order of `sampler`, pinned for fast, asynchronous copies to a GPU."""
    return DataLoader(
        dataset,
        sampler=BatchSampler(sampler, batch_size, drop_last=False),
        batch_size=None,  # the dataset builds whole batches itself
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
    )


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
