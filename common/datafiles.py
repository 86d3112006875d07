"""The data files as uint8 tensors: MNIST's IDX files and CIFAR's python batches, in their official
formats. The guard rails check each file before a stage reads it (common/guards/datafiles.py): a
file cut short, of another format, or with labels that do not fit its images is one line naming it
and the fix, not a traceback from numpy or a run that trains on less."""

import pickle

import numpy as np
import torch


def read_idx(path, ndim):
    """An IDX file of uint8 (MNIST's format) as a tensor: the bytes 0, 0, 0x08, ndim;
    ndim big-endian uint32 sizes; the data."""
    raw = np.fromfile(path, dtype=np.uint8)
    header = 4 + 4 * ndim
    return torch.from_numpy(raw[header:].reshape(raw[4:header].view(">u4").tolist()))


class NumpyOnly(pickle.Unpickler):
    """Unpickling runs whatever code a file names. A CIFAR batch holds dictionaries of numpy arrays,
    lists and bytes alone, so nothing else may be loaded: a crafted file fails, not runs."""

    # the official files name numpy.core, numpy >= 2 numpy._core
    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
    }

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise ValueError(f"{module}.{name} is not allowed in a CIFAR batch (numpy arrays only)")
        return super().find_class(module, name)


def read_cifar(paths, label_key):
    """CIFAR's python batches: b"data", uint8 N x 3072 (the red, green and blue planes of 32 x 32
    each), and the labels under label_key, a list of N integers; pickles, in which encoding="bytes"
    reads their Python 2 strings."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            batch = NumpyOnly(f, encoding="bytes").load()
        images.append(torch.from_numpy(np.asarray(batch[b"data"])))
        labels.append(torch.as_tensor(batch[label_key]))
    return torch.cat(images).view(-1, 3, 32, 32), torch.cat(labels)
