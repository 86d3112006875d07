"""The data sets (--dataset) from --data-dir, decoded once into tensors, and the loaders every stage uses
(--loader):

  batched  (default) the data set is one uint8 tensor; each batch is one indexing operation, pinned
           and copied to the GPU asynchronously: no PIL image, no per-sample Python
  classic  pytorch/examples' pipeline: one PIL image per sample through ToTensor and Normalize, as
           torchvision's data sets make them, collated per batch; the reference that `make profile` shows
  device   the whole (small) data set in GPU memory: batches are drawn there, nothing is copied

All three follow the sampler they are given, so a DistributedSampler shards each of them the same way.
The data sets are in torchvision's on-disk layout; `synthetic` is random images made in memory, for
benchmarks. The training scripts never download: compute nodes are often offline, and several ranks
must not write into one folder at once. `make data DATASET=...` (python -m common.data) prepares the
folder once.
"""

import argparse
import gzip
import hashlib
import math
import os
import pickle
import shutil
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader, Dataset

from common.environment import cpus_per_rank

FILES = {  # MNIST's sha256 of the uncompressed IDX files
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


class Spec(NamedTuple):
    folder: str  # under --data-dir, as torchvision lays it out
    files: list  # what must be there; for CIFAR, the last one is the test set
    mean: tuple  # per-channel pixel statistics of the training set, for Normalize
    std: tuple
    classes: int
    download: str = None  # the name of torchvision's class that downloads the set


CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
SETS = {
    "mnist": Spec("MNIST/raw", list(FILES), (0.1307,), (0.3081,), 10, "MNIST"),  # as in pytorch/examples
    "fashion-mnist": Spec("FashionMNIST/raw", list(FILES), (0.2860,), (0.3530,), 10, "FashionMNIST"),
    "cifar10": Spec("cifar-10-batches-py", CIFAR10_FILES, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 10, "CIFAR10"),
    "cifar100": Spec("cifar-100-python", ["train", "test"], (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 100, "CIFAR100"),
    "synthetic": Spec("", [], (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 10),
}  # fmt: skip
SYNTHETIC = {True: 50_000, False: 10_000}  # images of 3 x 32 x 32, as many as in CIFAR


class Images(Dataset):
    """A data set as one uint8 tensor N x C x H x W and its int64 labels. Indexed with a list of indices it
    returns a whole normalized batch, so a batch costs one tensor operation instead of 64 PIL images and
    a collate."""

    def __init__(self, name, images, labels, mean, std, classes):
        self.name, self.images, self.labels = name, images, labels
        self.mean, self.std, self.classes = tuple(mean), tuple(std), classes
        self.in_channels, self.image_size = images.shape[1], images.shape[-1]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, indices):
        indices = torch.as_tensor(indices, dtype=torch.long)
        return normalize(self.images[indices.clamp(min=0)], self.mean, self.std), label(self.labels, indices)

    def subset(self, indices):
        """The images at `indices`, in tensors of their own."""
        return Images(self.name, self.images[indices], self.labels[indices], self.mean, self.std, self.classes)


PAD = -100  # the label of a padding sample (index -1): F.nll_loss ignores it, and it is never a correct answer


def label(labels, indices):
    """The labels at `indices`, PAD where an index is -1 (a padding sample of shard())."""
    return torch.where(indices < 0, PAD, labels[indices.clamp(min=0)])


def shard(count, rank, world_size):
    """This rank's share of `count` evaluation samples: every world_size-th index from `rank`, padded with -1
    to the same length on every rank. Every rank then runs the same number of forward passes (under FSDP
    each one is a collective: a rank with one batch more would wait for a partner forever), and the padding
    counts nowhere (label PAD), so each sample counts exactly once."""
    indices = list(range(rank, count, world_size))
    return indices + [-1] * (math.ceil(count / world_size) - len(indices))


def normalize(images, mean, std):
    """uint8 N x C x H x W -> float, on the images' device, as ToTensor() and Normalize(mean, std) make it."""
    mean = torch.tensor(mean, device=images.device).view(-1, 1, 1)
    std = torch.tensor(std, device=images.device).view(-1, 1, 1)
    return images.float().div_(255).sub_(mean).div_(std)


def dataset(data_dir, name, train, limit=None):
    """The training (or test) set `name` of SETS, read from data_dir, its first `limit` images if given; a
    SystemExit saying what to do if it is not there."""
    spec = SETS[name]
    folder = Path(data_dir) / spec.folder
    missing = [file for file in spec.files if not (folder / file).is_file()]
    if missing:
        raise SystemExit(
            f"error: {name} is not in {folder} (missing {missing[0]}): run `make data DATASET={name}` on a machine "
            f"with internet access (the login node), or point --data-dir at a folder holding {spec.folder}/"
        )
    if name == "synthetic":
        images, labels = synthetic(SYNTHETIC[train], spec.classes, seed=int(train))
    elif name in ("mnist", "fashion-mnist"):
        prefix = "train" if train else "t10k"
        images = read_idx(folder / f"{prefix}-images-idx3-ubyte", 3, name).unsqueeze(1)
        labels_path = folder / f"{prefix}-labels-idx1-ubyte"
        labels = read_idx(labels_path, 1, name).long()
        check_labels(labels_path, labels, len(images), spec.classes, name)
    else:  # not torchvision's CIFAR classes: they check the MD5s of the official files, and refuse any other
        paths = [folder / file for file in (spec.files[:-1] if train else spec.files[-1:])]
        images, labels = read_cifar(paths, b"labels" if name == "cifar10" else b"fine_labels", spec.classes, name)
    return Images(name, images[:limit], labels[:limit], spec.mean, spec.std, spec.classes)


def bad_file(path, name, problem):
    """The error for a data file that is there but wrong: one line naming the file and the fix, no traceback
    from deep inside numpy or torch. Deleting it first matters: `make data` keeps the files it finds."""
    return SystemExit(
        f"error: {path}: {problem}: delete it and run `make data DATASET={name}` again "
        "(or point --data-dir at a good copy)"
    )


def read_idx(path, ndim, name):
    """An IDX file of uint8 (MNIST's format) as a tensor: the bytes 0, 0, 0x08, ndim; ndim big-endian uint32
    sizes; the data. The length must match the sizes exactly, so a truncated file cannot pass."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw[:4].tolist() != [0, 0, 8, ndim]:
        found = raw[:4].tobytes().hex(" ") or "nothing"
        raise bad_file(
            path, name, f"not an IDX file of {ndim}-dimensional uint8 (it starts with {found}, not 00 00 08 0{ndim})"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise bad_file(path, name, f"{len(raw)} bytes, too short for its {header}-byte header (truncated?)")
    sizes = raw[4:header].view(">u4").tolist()
    if len(raw) != header + math.prod(sizes):
        shape = " x ".join(map(str, sizes))
        raise bad_file(
            path, name, f"{len(raw)} bytes, not the {header + math.prod(sizes)} of its {shape} header (truncated?)"
        )
    return torch.from_numpy(raw[header:].reshape(sizes))


def check_labels(path, labels, count, classes, name):
    """One label per image, each a class of the set: a shorter labels file would otherwise train on a subset,
    and a label out of range fail in the loss with a message naming nothing."""
    if len(labels) != count:
        raise bad_file(path, name, f"{len(labels)} labels for {count} images")
    outside = ((labels < 0) | (labels >= classes)).nonzero()
    if len(outside):
        index = int(outside[0])
        raise bad_file(
            path, name, f"label {int(labels[index])} of image {index} is not one of the classes 0 to {classes - 1}"
        )


def synthetic(count, classes, seed):
    """Random 3 x 32 x 32 images and labels, the same for a seed: for benchmarks, nothing to learn."""
    generator = torch.Generator().manual_seed(seed)
    # eight pixels per 64-bit draw over the full int64 range: four times faster than one draw per pixel
    pixels = torch.empty(count * 3 * 32 * 32 // 8, dtype=torch.int64).random_(-(2**63), None, generator=generator)
    labels = torch.randint(classes, (count,), generator=generator)
    return pixels.view(torch.uint8).view(count, 3, 32, 32), labels


class NumpyOnly(pickle.Unpickler):
    """The CIFAR batches are pickles (the official format, with encoding="bytes" for their Python 2 strings),
    and unpickling can run any code a file names. These files hold dictionaries of numpy arrays, lists and
    bytes only, so nothing else may be loaded: a crafted file fails instead of running."""

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),  # the name in the official files
        ("numpy._core.multiarray", "_reconstruct"),  # numpy >= 2
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a CIFAR batch, which holds numpy arrays")
        return super().find_class(module, name)


def read_cifar(paths, label_key, classes, name):
    """CIFAR's python batches: b"data", uint8 N x 3072 (the red, green and blue planes of 32 x 32 each), and
    the labels under label_key, a list of N integers."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            try:
                batch = NumpyOnly(f, encoding="bytes").load()
                pixels, batch_labels = np.asarray(batch[b"data"]), torch.as_tensor(batch[label_key])
            except Exception as err:  # a truncated or foreign file: pickle alone raises a dozen kinds of error
                raise bad_file(path, name, f"not a CIFAR batch ({type(err).__name__}: {err})") from err
        if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32:
            shape = " x ".join(map(str, pixels.shape))
            raise bad_file(path, name, f"its data is {pixels.dtype} {shape}, not uint8 N x 3072")
        if batch_labels.dtype != torch.int64 or batch_labels.ndim != 1:
            raise bad_file(
                path, name, f"its labels are not a list of integers but {batch_labels.dtype} {list(batch_labels.shape)}"
            )
        check_labels(path, batch_labels, len(pixels), classes, name)
        images.append(torch.from_numpy(pixels))
        labels.append(batch_labels)
    return torch.cat(images).view(-1, 3, 32, 32), torch.cat(labels)


def fingerprint(dataset, samples=1000):
    """A short string that differs when two ranks read different data: the image count and shape, and a hash
    of every label and of at most `samples` images evenly strided through the set. Sampled to be cheap: hashing
    all of CIFAR-100's 150 MB takes each rank a quarter of a second at every start, 1,000 images a few
    milliseconds; the sizes and labels, which a truncated, reordered or different file changes, go in whole."""
    digest = hashlib.blake2b(str(tuple(dataset.images.shape)).encode(), digest_size=8)
    digest.update(dataset.labels.numpy().tobytes())
    digest.update(dataset.images[:: max(math.ceil(len(dataset) / samples), 1)].numpy().tobytes())
    return f"{len(dataset)}-{digest.hexdigest()}"


def split(dataset, fraction, seed):
    """(training part, validation part): `fraction` of the images, drawn at random with `seed`, held out
    for validation; both keep their images in the order of `dataset`. For fraction 0 the validation part
    is empty: evaluating it yields nothing, so the stages need no special case."""
    if not fraction:
        return dataset, dataset.subset([])
    held = round(len(dataset) * fraction)
    if not 0 < held < len(dataset):
        raise SystemExit(f"error: a validation fraction of {fraction} of {len(dataset)} images leaves a part empty")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return dataset.subset(order[held:].sort().values), dataset.subset(order[:held].sort().values)


class PerSample(Dataset):
    """What torchvision's data sets do per sample: a PIL image of the decoded array, ToTensor and Normalize.
    The DataLoader collates the samples into batches."""

    def __init__(self, dataset):
        # imported here, not at the top: torchvision doubles the time torch takes to import, which every rank
        # of the default (batched) loader and every --help would otherwise pay
        from torchvision import transforms

        self.images, self.labels = dataset.images, dataset.labels
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(dataset.mean, dataset.std)])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[max(index, 0)].permute(1, 2, 0).squeeze(2).numpy()  # H x W x C, or grey H x W, as PIL reads
        return self.transform(Image.fromarray(image)), int(label(self.labels, torch.tensor(index)))


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
            yield self.images[batch.clamp(min=0)], label(self.labels, batch)


def default_num_workers(env=os.environ):
    """DataLoader workers per process: the CPUs of this rank, but one for the process itself."""
    return cpus_per_rank(env) - 1


def num_workers(args):
    """The DataLoader workers of each rank: --num-workers, else the CPUs for the classic pipeline and none
    for the batched one, where a batch is one indexing operation and passing it from a worker costs more."""
    if args.loader == "device":
        return 0
    return default_num_workers() if args.num_workers is None and args.loader == "classic" else args.num_workers or 0


def loader(dataset, sampler, batch_size, args, device):
    """Batches of `dataset` in the order of `sampler`, by the pipeline --loader names."""
    if args.loader == "device":
        return OnDevice(dataset, sampler, batch_size, device)
    workers = num_workers(args)
    options = dict(
        num_workers=workers,
        pin_memory=device.type == "cuda",  # page-locked batches: the copy to the GPU can be asynchronous
        persistent_workers=workers > 0,
        # worker seeds from a generator of their own: the global RNG, which checkpoints save, then
        # advances the same in a resumed run (a new loader) as in an uninterrupted one
        generator=torch.Generator(),
    )
    if args.loader == "classic":
        return DataLoader(PerSample(dataset), batch_size=batch_size, sampler=sampler, **options)
    # batched: the sampler's indices come in lists of batch_size, and the dataset builds each batch
    return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last=False), batch_size=None, **options)


def download(name, data_dir, train):
    from torchvision import datasets  # here, as in PerSample: only `make data` downloads

    try:
        getattr(datasets, SETS[name].download)(data_dir, train=train, download=True)
    except (OSError, RuntimeError) as err:  # no network: torchvision's URLError, or its last mirror's RuntimeError
        raise SystemExit(
            f"error: cannot download {name} ({err}): run `make data DATASET={name}` on a machine with internet "
            f"access, or copy its {SETS[name].folder}/ into {data_dir}"
        ) from err


def prepare(data_dir, name="mnist"):
    """Make `name` ready in data_dir. MNIST: unpack the vendored .gz files after checking them, downloading
    only if absent; the others: torchvision's download, which checks them."""
    folder = Path(data_dir) / SETS[name].folder
    if name == "synthetic":
        print("synthetic is made in memory: nothing to prepare")
        return
    if name != "mnist":
        download(name, data_dir, train=True)
        download(name, data_dir, train=False)
        print(f"{name} ready in {folder}")
        return
    if not all((folder / f"{file}.gz").is_file() or (folder / file).is_file() for file in FILES):
        download(name, data_dir, train=True)
        download(name, data_dir, train=False)
    for file, sha256 in FILES.items():
        if not (folder / file).is_file():
            part = folder / f"{file}.part"
            try:
                with gzip.open(folder / f"{file}.gz") as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (OSError, EOFError, zlib.error) as err:  # a download cut short, or not gzip at all
                part.unlink(missing_ok=True)
                raise SystemExit(
                    f"error: {folder / file}.gz is damaged ({err}): delete it and run `make data` again"
                ) from None
            part.replace(folder / file)
        if hashlib.sha256((folder / file).read_bytes()).hexdigest() != sha256:
            raise SystemExit(
                f"error: {folder / file} is corrupt (sha256 mismatch): delete it and run `make data` again"
            )
    print(f"MNIST ready in {folder}")


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Prepare a data set in DATA_DIR (make data DATASET=NAME).")
    default = Path(__file__).resolve().parent.parent / "data"
    cli.add_argument("data_dir", nargs="?", type=Path, default=default, metavar="DATA_DIR",
                     help="the stages' --data-dir (default: the repository's data/)")  # fmt: skip
    cli.add_argument("name", nargs="?", choices=list(SETS), default="mnist", metavar="NAME",
                     help=f"one of {', '.join(SETS)} (default: mnist)")  # fmt: skip
    args = cli.parse_args()
    prepare(args.data_dir, args.name)
