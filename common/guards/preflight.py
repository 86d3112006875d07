"""Guard rail: checks before the first step, so that ranks that cannot train the same run end in seconds with one
line naming the fix: every rank trains the same options on the same data (a fingerprint of it, which the run's
manifest records), data sets a run can resume in, and a folder stage 05's ranks share (the launch itself:
launching.py)."""

import hashlib
import math
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import IterableDataset

from common import data
from common.environment import is_rank0
from common.guards import options, samples
from common.guards.ending import stop
from common.options import loaders
from common.options.flags import LARGE


class Task(type(Path())):
    """--task's path, with the bytes the run loaded from it (`source`: cli.load_task() reads the file once, runs and
    keeps them): what the run records of its task is what it runs, though the file changes or goes after (a task
    that deletes itself as it is loaded was a FileNotFoundError when the manifest was written). Made from the path
    alone, as pathlib makes the paths it derives (Python 3.12 passes a constructor's every argument to Path)."""

    @classmethod
    def loaded(cls, path, source, scheduled=False):
        task = cls(path)
        task.source, task.scheduled = source, scheduled  # scheduled: it defines scheduler(), which may read --epochs
        return task


def defining(args):
    """{dest: value} of the options that define what a run computes: all but options.FREE and a value the recipe
    never reads (options.used()), the task's own too, as plain values for the run's manifest (JSON). A cosine
    schedule's --epochs too: it decays to 0 over them; and a task's own scheduler()'s, which may (examples/recipe.py
    does: resumed with another --epochs, its cosine went up again, 95 % where the run reached 99)."""
    # a flag of stage 05's alone, as the other stages run without it (flags.LARGE: one micro-batch): another
    # --grad-accum, resumed across stages, is another run
    read = options.used(LARGE | vars(args))
    values = {k: str(v) if isinstance(v, Path) else v for k, v in read.items() if k not in options.FREE}
    # where the file lies may change; which task it is may not: its name and what it holds, as it was loaded
    source = args.task.source if isinstance(args.task, Task) else args.task.read_bytes()
    values["task"] = f"{args.task.name} (sha256 {hashlib.sha256(source).hexdigest()[:16]})"
    if args.scheduler == "cosine" or getattr(args.task, "scheduled", False):  # a task's cosine over --epochs too
        values["epochs"] = args.epochs
    return values


def same(value, other):
    """Are two values of an option the same? A NaN too (a task's default), which == finds unequal to itself."""
    return value == other or repr(value) == repr(other)


def fingerprint(dataset, samples=1000):
    """A short string that differs when two ranks read different data: the size, and a hash of at most `samples`
    samples evenly strided through the set (of a data set in tensors, common/data.py Images, of all labels and
    the strided images, which is faster). Sampled to be cheap: hashing all of CIFAR-100's 150 MB takes each
    rank a quarter of a second at every start; a truncated, reordered or different file changes it. Each sample
    is drawn with torch's, numpy's and random's generators fixed (common/options/loaders.py Seeded): a random augmentation
    draws the same on every rank and in every run, so the hash is the data's, not one draw of the augmentation."""
    stride = max(math.ceil(len(dataset) / samples), 1)
    if isinstance(dataset, data.Images):
        digest = hashlib.blake2b(str(tuple(dataset.images.shape)).encode(), digest_size=8)
        digest.update(dataset.labels.numpy().tobytes())
        digest.update(dataset.images[::stride].numpy().tobytes())
        return f"{len(dataset)}-{digest.hexdigest()}"
    digest = hashlib.blake2b(digest_size=8)
    for i in range(0, len(dataset), stride):  # every tensor of a sample, however nested; other values as text
        for leaf in pytree.tree_leaves(item(dataset, i)):
            digest.update(as_bytes(leaf))
    if len(dataset):
        item(dataset, len(dataset) - 1)  # the last item, which a __len__ that counts too many lacks
    return f"{len(dataset)}-{digest.hexdigest()}"


def as_bytes(leaf):
    """A tensor's bytes (numpy has no bfloat16: viewed as bytes first); of another value what numpy reads of it (an
    array, a PIL image, a number, a text), else its type's name alone: a repr() may hold an address that differs
    in every process, or leave out the middle of an array."""
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    try:
        array = loaders.numpy.asarray(leaf)
    except (ValueError, TypeError, AttributeError):  # ragged nested lists; no numpy
        array = None
    if array is None or array.dtype.hasobject:
        return type(leaf).__qualname__.encode()
    return f"{array.dtype}{array.shape}".encode() + array.tobytes()


def drawn(dataset, indices):
    """The items at `indices` as the loader draws them in epoch 0 (Seeded), uncollated; the run's generators kept."""
    return loaders.Seeded(dataset, 0, list)[[(i, 0) for i in indices]]


def item(dataset, i):
    """dataset[i], or one line before the first step: a __len__ that counts more items than __getitem__ has."""
    try:
        return drawn(dataset, [i])[0]  # every generator fixed: the data, not one draw of an augmentation
    except Exception as err:  # the user's data set: anything can fail here
        stop(
            f"error: item {i} of a data set whose __len__ is {len(dataset)} fails ({type(err).__name__}: "
            f"{str(err)[:100]}): its __len__ must count the items __getitem__ returns, and each must load"
        )


def check_datasets(args, task, *datasets):
    """What the task's datasets() returned: map-style data sets of (input, label) pairs, each a tensor or nested
    dicts, lists and tuples of them, a label a class number unless the task has its own loss or metric; and
    that its collate() (else stacking) batches the first two samples into an (input, label) pair."""
    samples.check_metric(args, task)
    for name, found in zip(("training", "test"), datasets, strict=False):
        if isinstance(found, IterableDataset):  # a stream has no index to resume at, nor a shard per rank
            stop(
                f"error: --task {args.task}: its {name} set is an IterableDataset: a run resumes at the exact sample "
                "where it stopped, and every rank evaluates its own samples, which needs indices: return a map-style "
                "Dataset (__len__ and __getitem__), e.g. one that reads the stream's items by index from files"
            )
        if isinstance(found, data.Images):  # read whole batches, never probed an item at a time
            continue
        if len(found) == 0:  # an evaluation of nothing would divide by zero; a training of nothing is no run
            stop(f"error: --task {args.task}: its {name} set is empty (check the path it reads, and --limit)")
        try:
            x, y = drawn(found, [0])[0]
            floats = [t.dtype for t in pytree.tree_leaves(y) if torch.is_tensor(t) and t.is_floating_point()]
            if (floats or isinstance(y, float)) and not hasattr(task, "loss"):  # soft labels, unsaid
                raise TypeError(
                    f"a label of {floats[0] if floats else float}: the default loss, cross-entropy, takes class "
                    "numbers; define loss(output, target) (and metric, score()) for float or multi-hot targets"
                )
        except Exception as err:  # the user's data set: anything can fail here
            stop(
                f"error: --task {args.task}: datasets() must return (training set, test set) of torch.utils.data "
                f"Datasets whose items are (input, label), the label a class number by default; its {name} set's "
                f"first item fails that ({type(err).__name__}: {str(err)[:200]})"
            )
        samples.check_collate(args, task, name, drawn(found, range(min(len(found), 2))))
    if args.limit is not None and (longer := [len(d) for d in datasets if len(d) > args.limit]):  # a quick run's
        stop(
            f"error: --task {args.task}: --limit {args.limit}, but its datasets() returned a set of {longer[0]} "
            "samples: cut each set to its first args.limit in datasets() (common/tasks/README.md), or drop --limit"
        )
    if args.loader == "device" and not all(isinstance(d, data.Images) for d in datasets):
        stop(
            f"error: --loader device holds a data set of tensors (common/data.py Images) on the GPU; --task "
            f"{args.task}'s is a {type(datasets[0]).__name__}: use --loader batched (the default) or classic"
        )


NODE_LOCAL = ("num_workers", "loader", "dist_timeout", "log_interval", "checkpoint_minutes")  # each node's own


def agree(args, task, *datasets):
    """Before the first step: every rank must train the same run on the same data. A difference in the options that
    define it, or in its data sets' fingerprints, ends every rank with the option and the ranks that differ."""
    check_datasets(args, task, *datasets)
    if not dist.is_initialized():
        return
    # every option, not only those that define the run: another --epochs, --target or --test-batch-size on one node
    # ran other collectives, a hang until --dist-timeout naming none; but what a node may have its own of
    # (NODE_LOCAL; paths: a node's copy of the data, whose fingerprint is compared below), and --resume by whether it
    # is given (rank 0 alone reads the checkpoint). The output folder too: a default one follows SLURM_STEP_ID,
    # which a rank started by hand may set otherwise
    own = [k for k, v in vars(args).items() if k in NODE_LOCAL or isinstance(v, Path)]
    shared = {k: str(v) for k, v in vars(args).items() if k not in own} | defining(args)
    shared |= {"resume": args.resume is not None, "output_dir": str(args.output_dir)}
    mine = {f"--{k.replace('_', '-')}": v for k, v in shared.items()}
    for name, dataset in zip(("training", "test"), datasets, strict=False):
        mine[f"the {name} data set ({len(dataset)} samples here)"] = fingerprint(dataset)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key, value in everyone[0].items():
        differ = [f"rank {r}: {got}" for r, got in enumerate(t.get(key) for t in everyone) if not same(got, value)]
        if differ:  # the same verdict on every rank; rank 0 says it
            own = " (the default --output-dir: with no job id nor torchrun's --rdzv-id, each rank names its own)"
            stop(
                f"error: the ranks differ in {key}: rank 0: {value}, {', '.join(differ)}: give every rank the same "
                f"options and data{own if key == '--output-dir' else ''}"
            )


def first_bytes(path):
    """The first 4 KiB of `path`, or None: never through a link, nor waiting on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.pread(fd, 4096, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def check_shared(output_dir, fd):
    """Stage 05, before the first step: every rank writes and reads shards in the output folder, so every node
    must see the folder rank 0 writes in; one line naming the hosts that cannot. The probe is the folder's lock
    (`fd`, rank 0's: lock.claim()), which names its holder: no file is made or deleted, none a user may own."""
    box = [os.pread(fd, 4096, 0) if is_rank0() else None]  # host, pid and start time of rank 0
    dist.broadcast_object_list(box)
    # rank 0 never opens its lock again: closing any descriptor of it would release its POSIX lock
    seen = is_rank0() or first_bytes(output_dir / ".lock") == box[0]
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else socket.gethostname())
    if any(blind):
        stop(
            f"error: {output_dir} is not shared: {', '.join(sorted(set(filter(None, blind))))} cannot see rank 0's "
            "checkpoint: in stage 05 every rank writes and reads shards there: choose an --output-dir that every "
            "node sees"
        )
