"""Guard rail: a data file is checked before it is trusted. A file that is there but wrong (truncated, of
another format, a labels file shorter than its images, a label outside the classes, a CIFAR batch that is no
CIFAR batch or names more than numpy arrays) is one line naming the file and the fix, before the lesson reads
it (common/datafiles.py), instead of a traceback from deep inside numpy or torch, or a run that silently trains
on less. check() reads the files of the stage's --dataset (any task's: of every set) as common/data.py dataset()
will, when a stage starts (check.check_args()); a missing file is left to dataset(), which names `make data`."""

import itertools
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from common import data
from common.datafiles import NumpyOnly, read_idx
from common.guards.bounded import regular_file
from common.guards.ending import Refusal


class BadFile(ValueError):
    """A data file that is there but wrong: its message names the file and the fix, instead of a
    traceback from deep inside numpy or torch. Deleting it first matters: prepare_data.py keeps the
    files it finds. Its command for the folder the file is in (`make data` writes data/ alone)."""

    def __init__(self, path, name, problem):
        data_dir = path.parents[len(Path(data.SETS[name].folder).parts)]
        fix = f"delete it and run `python tools/prepare_data.py {data_dir} {name}` again (or point --data-dir at a good copy)"
        super().__init__(f"{path}: {problem}: {fix}")


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


def check_idx(path, ndim, name):
    """The sizes an IDX file of uint8 declares: its bytes 0, 0, 0x08, ndim, then ndim big-endian uint32 sizes.
    Its length must match them: no truncated file passes. Only the header is read."""
    header = 4 + 4 * ndim
    with open(regular_file(path), "rb") as f:
        head, length = f.read(header), os.fstat(f.fileno()).st_size
    if head[:4] != bytes([0, 0, 8, ndim]):
        found = head[:4].hex(" ") or "nothing"
        raise BadFile(
            path, name, f"not an IDX file of {ndim}-dimensional uint8 (it starts with {found}, not 00 00 08 0{ndim})"
        )
    if length < header:
        raise BadFile(path, name, f"{length} bytes, too short for its {header}-byte header (truncated?)")
    sizes = struct.unpack(f">{ndim}I", head[4:])
    if length != header + math.prod(sizes):
        shape = " x ".join(map(str, sizes))
        raise BadFile(
            path, name, f"{length} bytes, not the {header + math.prod(sizes)} of its {shape} header (truncated?)"
        )
    return sizes


def check_cifar(path, label_key, classes, name):
    """A CIFAR python batch: a pickle of numpy arrays alone, b"data" uint8 N x 3072, N integer labels."""
    with open(regular_file(path), "rb") as f:
        try:
            batch = NumpyOnly(f, encoding="bytes").load()
            pixels, labels = np.asarray(batch[b"data"]), torch.as_tensor(batch[label_key])
        except Exception as err:
            # a truncated or foreign file: pickle alone raises a dozen kinds of error
            raise BadFile(path, name, f"not a CIFAR batch ({type(err).__name__}: {err})") from err
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 3 * 32 * 32:
        shape = " x ".join(map(str, pixels.shape))
        raise BadFile(path, name, f"its data is {pixels.dtype} {shape}, not uint8 N x 3072")
    if labels.dtype != torch.int64 or labels.ndim != 1:
        raise BadFile(path, name, f"its labels are not a list of integers but {labels.dtype} {list(labels.shape)}")
    check_labels(path, labels, len(pixels), classes, name)


def check_set(data_dir, name, train):
    """The files of the training (or test) set `name` of common/data.py's SETS that dataset() reads, those
    that are there; a BadFile for the first that is wrong."""
    spec = data.SETS[name]
    folder = Path(data_dir) / spec.folder
    if name in ("mnist", "fashion-mnist"):
        prefix = "train" if train else "t10k"
        images, labels = folder / f"{prefix}-images-idx3-ubyte", folder / f"{prefix}-labels-idx1-ubyte"
        if images.is_file() and labels.is_file():
            count = check_idx(images, 3, name)[0]
            check_idx(labels, 1, name)
            check_labels(labels, read_idx(labels, 1).long(), count, spec.classes, name)
    elif name in ("cifar10", "cifar100"):
        key = b"labels" if name == "cifar10" else b"fine_labels"
        for file in spec.files[:-1] if train else spec.files[-1:]:
            if (folder / file).is_file():
                check_cifar(folder / file, key, spec.classes, name)


def check(args):
    """The files of --dataset (common/tasks/images.py's option), else of every set of common/data.py in --data-dir:
    a task without the option may read any (common/tasks/augmented.py reads MNIST's); before any is read, one
    line naming the file and the fix."""
    names = [args.dataset] if getattr(args, "dataset", None) in data.SETS else data.SETS
    try:
        for name, train in itertools.product(names, (True, False)):
            check_set(args.data_dir, name, train)
    except BadFile as err:
        raise Refusal(f"error: {err}") from None
