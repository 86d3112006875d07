"""Guard rail: checks before the first step, so that a launch that cannot work ends in seconds with one line
naming the fix, instead of a hang or an error deep in torch: numbers that fit together, a device and a
network interface that exist, and ranks that train the same run on the same data."""

import hashlib
import importlib.util
import math
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import IterableDataset

from common import amp, data
from common.environment import is_rank0
from common.guards import options, samples
from common.guards.ending import Refusal, stop
from common.sampling import Seeded, numpy


def check_device(args, local_rank):
    """The device setup() will pick must exist and suit the options."""
    if not torch.cuda.is_available() or args.no_cuda:
        check_cpu_options(args)
        return check_compile(args, torch.device("cpu"))
    check_gpus(local_rank, torch.cuda.device_count())
    check_compile(args, torch.device("cuda"))


def check_launch(launch, args):
    rank, local_rank, world_size = launch.rank, launch.local_rank, launch.world_size
    if not (0 <= rank < world_size and 0 <= local_rank <= rank):
        raise Refusal(f"error: inconsistent launch: rank {rank}, local rank {local_rank}, world size {world_size}: "
                         "the launcher sets them (rank < world size, local rank <= rank): set by hand, correct them")  # fmt: skip
    if args.batch_size % world_size:  # every rank alike, so rank 0 alone says it; a resume keeps --batch-size
        # up to 1024 ranks: a divisor search over a typo's 10**12 would keep every rank busy for minutes
        sizes = ", ".join(str(n) for n in range(1, min(args.batch_size, 1024) + 1) if args.batch_size % n == 0)
        raise Refusal(f"error: --batch-size {args.batch_size} is the global batch: it must divide by the world size "
                         f"{world_size}: run on {sizes} ranks" if rank == 0 else 1)  # fmt: skip
    per_rank = args.batch_size // world_size
    if hasattr(args, "grad_accum") and args.grad_accum > per_rank and rank == 0:  # torch.chunk makes fewer
        print(f"warning: --grad-accum {args.grad_accum} is more than the {per_rank} images each rank computes per "
              f"step: each rank runs {per_rank} micro-batches of one image", flush=True)  # fmt: skip
    check_amp(args, launch)


def check_amp(args, launch):
    """Stage 05's --amp is FSDP's mixed precision (amp.policies()), in bf16: refused, never ignored, where there
    is no FSDP to use it or no bf16 (fp16 would need a sharded loss scaler). Stage 05 alone has --full-shard."""
    if not (getattr(args, "amp", False) and hasattr(args, "full_shard")):
        return
    if not launch.addr:  # no launcher: no process group, nothing is sharded
        raise Refusal("error: --amp in stage 05 is FSDP's mixed precision, which a plain `python train.py` does "
                         "not use: launch with torchrun or srun (one GPU: torchrun --standalone --nproc_per_node=1 "
                         "train.py --amp)")  # fmt: skip
    if torch.cuda.is_available() and not args.no_cuda and amp.dtype(torch.device("cuda")) != torch.bfloat16:
        raise Refusal("error: --amp in stage 05 computes in bf16, which this GPU lacks (fp16 would need a "
                         "sharded loss scaler): drop --amp, or use stage 04 with --amp")  # fmt: skip


def check_cpu_options(args):
    if args.sync_bn:
        raise Refusal("error: --sync-bn needs GPUs (PyTorch's SyncBatchNorm runs on CUDA only): drop it on CPUs")


def check_compile(args, device):
    """--compile needs what torch.compile generates code with: a C++ compiler for the CPU, Triton for GPUs."""
    if not getattr(args, "compile", False):  # the doctor's options have no --compile
        return
    import torch._dynamo  # here: a run without --compile never loads the compiler stack

    if not torch._dynamo.is_dynamo_supported():
        raise Refusal(f"error: --compile: torch {torch.__version__} cannot compile on Python {sys.version.split()[0]}: "
                         "drop --compile, or use a Python this torch supports")  # fmt: skip
    if device.type == "cpu" and not any(
        shutil.which(cc) for cc in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")
    ):
        raise Refusal(
            "error: --compile on the CPU needs a C++ compiler (g++) on PATH: `module load gcc`, or drop --compile"
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise Refusal("error: --compile on GPUs needs Triton, which this torch lacks: `pip install triton` "
                         "(the version torch pins), or drop --compile")  # fmt: skip


def check_gpus(local_rank, visible):
    if visible > 1 and local_rank >= visible:
        raise Refusal(
            f"error: local rank {local_rank} but only {visible} GPUs are visible on {socket.gethostname()}: "
            "ask Slurm for as many tasks per node as GPUs per node (--ntasks-per-node = --gres=gpu:N)"
        )


def check_interfaces(backend):
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME must name interfaces this host has: gloo would stop with a
    C++ stack trace, NCCL at its first collective. NCCL takes prefixes ("ib" for ib0), "=" exact names and
    "^" names to avoid; gloo exact names, each of which must exist."""
    name = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    wanted, here = os.environ.get(name, ""), sorted(n for _, n in socket.if_nameindex())
    if not wanted or wanted.startswith("^"):
        return
    names = wanted.lstrip("=").split(",")
    if backend == "nccl":  # one matching interface is enough
        missing = [] if any(h == n or (wanted[0] != "=" and h.startswith(n)) for h in here for n in names) else names
    else:
        missing = [n for n in names if n not in here]
    if missing:
        raise Refusal(
            f"error: {name}={wanted} but {socket.gethostname()} has no interface {', '.join(missing)} (it has "
            f"{', '.join(here)}): set it to the interface of the network the nodes share, or unset it"
        )


def defining(args):
    """{dest: value} of the options that define what a run computes: all but options.FREE, the task's own too, as
    plain values for the run's manifest (JSON). A cosine schedule's --epochs too: it decays to 0 over them."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in options.FREE}
    values["task"] = args.task.name  # where the file lies may change; which task it is may not
    if args.scheduler == "cosine":
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
    is drawn with torch's, numpy's and random's generators fixed (common/sampling.py Seeded): a random augmentation
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
        array = numpy.asarray(leaf)
    except (ValueError, TypeError, AttributeError):  # ragged nested lists; no numpy
        array = None
    if array is None or array.dtype.hasobject:
        return type(leaf).__qualname__.encode()
    return f"{array.dtype}{array.shape}".encode() + array.tobytes()


def drawn(dataset, indices):
    """The items at `indices` as the loader draws them in epoch 0 (Seeded), uncollated; the run's generators kept."""
    return Seeded(dataset, 0, list)[[(i, 0) for i in indices]]


def item(dataset, i):
    """dataset[i], or one line before the first step: a __len__ that counts more items than __getitem__ has."""
    try:
        return drawn(dataset, [i])[0]  # every generator fixed: the data, not one draw of an augmentation
    except Exception as err:  # the user's data set: anything can fail here
        stop(f"error: item {i} of a data set whose __len__ is {len(dataset)} fails ({type(err).__name__}: "
             f"{str(err)[:100]}): its __len__ must count the items __getitem__ returns, and each must load")  # fmt: skip


def check_datasets(args, task, *datasets):
    """What the task's datasets() returned: map-style data sets of (input, label) pairs, each a tensor or nested
    dicts, lists and tuples of them, a label a class number unless the task has its own loss or metric; and
    that its collate() (else stacking) batches the first two samples into an (input, label) pair."""
    samples.check_metric(args, task)
    for name, found in zip(("training", "test"), datasets, strict=False):
        if isinstance(found, IterableDataset):  # a stream has no index to resume at, nor a shard per rank
            stop(f"error: --task {args.task}: its {name} set is an IterableDataset: a run resumes at the exact sample "
                 "where it stopped, and every rank evaluates its own samples, which needs indices: return a map-style "
                 "Dataset (__len__ and __getitem__), e.g. one that reads the stream's items by index from files")  # fmt: skip
        if isinstance(found, data.Images):  # read whole batches, never probed an item at a time
            continue
        if len(found) == 0:  # an evaluation of nothing would divide by zero; a training of nothing is no run
            stop(f"error: --task {args.task}: its {name} set is empty (check the path it reads, and --limit)")
        try:
            x, y = drawn(found, [0])[0]
            floats = [t.dtype for t in pytree.tree_leaves(y) if torch.is_tensor(t) and t.is_floating_point()]
            if (floats or isinstance(y, float)) and not hasattr(task, "loss") and not hasattr(task, "metric"):
                raise TypeError(f"a label of {floats[0] if floats else float}: cross-entropy and accuracy count "
                                "class numbers; define loss() and metric, score() for other targets")  # fmt: skip
        except Exception as err:  # the user's data set: anything can fail here
            stop(f"error: --task {args.task}: datasets() must return (training set, test set) of torch.utils.data "
                 f"Datasets whose items are (input, label), the label a class number by default; its {name} set's "
                 f"first item fails that ({type(err).__name__}: {str(err)[:200]})")  # fmt: skip
        samples.check_collate(args, task, name, drawn(found, range(min(len(found), 2))))
    if args.loader == "device" and not all(isinstance(d, data.Images) for d in datasets):
        stop(
            f"error: --loader device holds a data set of tensors (common/data.py Images) on the GPU; --task "
            f"{args.task}'s is a {type(datasets[0]).__name__}: use --loader batched (the default) or classic"
        )


def agree(args, task, *datasets):
    """Before the first step: every rank must train the same run on the same data. A difference in the options that
    define it, or in its data sets' fingerprints, ends every rank with the option and the ranks that differ."""
    check_datasets(args, task, *datasets)
    if not dist.is_initialized():
        return
    # the output folder too: a default one follows SLURM_STEP_ID, which a rank started by hand may set otherwise
    mine = {f"--{k.replace('_', '-')}": v for k, v in defining(args).items()} | {"--output-dir": str(args.output_dir)}
    for name, dataset in zip(("training", "test"), datasets, strict=False):
        mine[f"the {name} data set ({len(dataset)} samples here)"] = fingerprint(dataset)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key, value in everyone[0].items():
        differ = [f"rank {r}: {got}" for r, got in enumerate(t.get(key) for t in everyone) if not same(got, value)]
        if differ:  # the same verdict on every rank; rank 0 says it
            stop(f"error: the ranks differ in {key}: rank 0: {value}, {', '.join(differ)}: give every rank the same "
                 "options and data")  # fmt: skip


def check_shared(output_dir):
    """Stage 05, before the first step: every rank writes and reads shards in the output folder, so every node
    must see the folder rank 0 writes in; one line naming the hosts that cannot."""
    probe = output_dir / ".shared"  # the folder's lock keeps other runs out of it
    if is_rank0():
        probe.touch()
    dist.barrier()
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if probe.exists() else socket.gethostname())
    if is_rank0():
        probe.unlink()
    if any(blind):
        stop(f"error: {output_dir} is not shared: {', '.join(sorted(set(filter(None, blind))))} cannot see rank 0's "
             "checkpoint: in stage 05 every rank writes and reads shards there: choose an --output-dir that every "
             "node sees")  # fmt: skip
