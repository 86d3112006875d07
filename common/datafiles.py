"""Guard rail: data files are checked as they are read. A file that is there but wrong (truncated,
of another format, a labels file shorter than its images, a label outside the classes, a CIFAR batch
that is no CIFAR batch) is one line naming the file and the fix, instead of a traceback from deep
inside numpy or torch, or a run that silently trains on less. common/data.py reads them all here."""

import math
import pickle

import numpy as np
import torch

from common.environment import regular_file


class BadFile(ValueError):
    """A data file that is there but wrong: its message names the file and the fix, instead of a
    traceback from deep inside numpy or torch. Deleting it first matters: `make data` keeps the
    files it finds."""

    def __init__(self, path, name, problem):
        fix = f"delete it and run `make data DATASET={name}` again (or point --data-dir at a good copy)"
        super().__init__(f"{path}: {problem}: {fix}")


def read_idx(path, ndim, name):
    """An IDX file of uint8 (MNIST's format) as a tensor: the bytes 0, 0, 0x08, ndim; ndim
    big-endian uint32 sizes; the data. The length must match the sizes: no truncated file passes."""
    raw = np.fromfile(regular_file(path), dtype=np.uint8)
    if raw[:4].tolist() != [0, 0, 8, ndim]:
        found = raw[:4].tobytes().hex(" ") or "nothing"
        raise BadFile(
            path, name, f"not an IDX file of {ndim}-dimensional uint8 (it starts with {found}, not 00 00 08 0{ndim})"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise BadFile(path, name, f"{len(raw)} bytes, too short for its {header}-byte header (truncated?)")
    sizes = raw[4:header].view(">u4").tolist()
    if len(raw) != header + math.prod(sizes):
        shape = " x ".join(map(str, sizes))
        raise BadFile(
            path, name, f"{len(raw)} bytes, not the {header + math.prod(sizes)} of its {shape} header (truncated?)"
        )
    return torch.from_numpy(raw[header:].reshape(sizes))


def check_labels(path, labels, count, classes, name):
    """One label per image, each a class of the set: a shorter labels file would otherwise train on
    a subset, and a label out of range fail in the loss with a message naming nothing."""
    if len(labels) != count:
        raise BadFile(path, name, f"{len(labels)} labels for {count} images")
    outside = ((labels < 0) | (labels >= classes)).nonzero()
    if len(outside):
        index = int(outside[0])
        raise BadFile(
            path, name, f"label {int(labels[index])} of image {index} is not one of the classes 0 to {classes - 1}"
        )


class NumpyOnly(pickle.Unpickler):
    """The CIFAR batches are pickles (the official format, with encoding="bytes" for their Python 2
    strings), and unpickling can run any code a file names. These files hold dictionaries of numpy
    arrays, lists and bytes only, so nothing else may be loaded: a crafted file fails, not runs."""

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
    """CIFAR's python batches: b"data", uint8 N x 3072 (the red, green and blue planes of 32 x 32
    each), and the labels under label_key, a list of N integers."""
    images, labels = [], []
    for path in paths:
        with open(regular_file(path), "rb") as f:
            try:
                batch = NumpyOnly(f, encoding="bytes").load()
                pixels, batch_labels = np.asarray(batch[b"data"]), torch.as_tensor(batch[label_key])
            except Exception as err:
                # a truncated or foreign file: pickle alone raises a dozen kinds of error
                raise BadFile(path, name, f"not a CIFAR batch ({type(err).__name__}: {err})") from err
        if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32:
            shape = " x ".join(map(str, pixels.shape))
            raise BadFile(path, name, f"its data is {pixels.dtype} {shape}, not uint8 N x 3072")
        if batch_labels.dtype != torch.int64 or batch_labels.ndim != 1:
            raise BadFile(
                path, name, f"its labels are not a list of integers but {batch_labels.dtype} {list(batch_labels.shape)}"
            )
        check_labels(path, batch_labels, len(pixels), classes, name)
        images.append(torch.from_numpy(pixels))
        labels.append(batch_labels)
    return torch.cat(images).view(-1, 3, 32, 32), torch.cat(labels)
