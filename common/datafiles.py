"""The data files as uint8 tensors: MNIST's IDX files and CIFAR's python batches, in their official formats.
The guard rails check each file before a stage reads it (common/guards/datafiles.py): a file cut short, of
another format is one line naming it and the fix, not a traceback from numpy."""

import pickle

import numpy as np
import torch


class BadFile(ValueError):
    """A data file that is there but wrong: its message names the file and the fix, instead of a
    traceback from deep inside numpy or torch. Deleting it first matters: `make data` keeps the
    files it finds."""

    def __init__(self, path, name, problem):
        fix = f"delete it and run `make data DATASET={name}` again (or point --data-dir at a good copy)"
        super().__init__(f"{path}: {problem}: {fix}")


def read_idx(path, ndim, name):
    """An IDX file of uint8 (MNIST's format) of the set `name` as a tensor: the bytes 0, 0, 0x08, ndim;
    ndim big-endian uint32 sizes; the data."""
    raw = np.fromfile(path, dtype=np.uint8)
    header = 4 + 4 * ndim
    return torch.from_numpy(raw[header:].reshape(raw[4:header].view(">u4").tolist()))


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
    """Unpickling runs whatever code a file names. A CIFAR batch holds dictionaries of numpy arrays,
    lists and bytes alone, so nothing else may be loaded: a crafted file fails, not runs."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct")}  # the official files' name; numpy >= 2's  # fmt: skip

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise ValueError(f"{module}.{name} is not allowed in a CIFAR batch, which holds numpy arrays")
        return super().find_class(module, name)


def read_cifar(paths, label_key, classes, name):
    """CIFAR's python batches: b"data", uint8 N x 3072 (the red, green and blue planes of 32 x 32
    each), and the labels under label_key, a list of N integers; pickles, in which encoding="bytes"
    reads their Python 2 strings."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            batch = NumpyOnly(f, encoding="bytes").load()
        images.append(torch.from_numpy(np.asarray(batch[b"data"])))
        labels.append(torch.as_tensor(batch[label_key]))
        check_labels(path, labels[-1], len(images[-1]), classes, name)
    return torch.cat(images).view(-1, 3, 32, 32), torch.cat(labels)
