"""Guard rail: checks before the first step, so that a launch that cannot work ends in seconds with one line
naming the fix, instead of a hang or an error deep in torch: numbers that fit together, a device and a
network interface that exist, and ranks that train the same run on the same data."""

import hashlib
import importlib.util
import math
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common import cli
from common.environment import cpus_per_rank, is_rank0
from common.guards.ending import stop

REQUIRED = object()


def integer(name, default=REQUIRED, env=os.environ, low=0, high=None):
    """env[name] as an integer in [low, high]; `default` if it is unset or empty, or an error if required. A
    variable missing where the launch needs it, or set but not a number in range (a typo in a launch by hand,
    a wrapper exporting garbage), is one line naming it and its value instead of a ValueError or KeyError."""
    value = env.get(name, "").strip()
    if not value:
        if default is REQUIRED:
            raise SystemExit(
                f"error: {name} is not set, and this launch needs it: start the ranks with torchrun or srun (or, "
                "by hand, set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank)"
            )
        return default
    if not value.isdigit() or int(value) < low or (high is not None and int(value) > high):
        within = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise SystemExit(
            f"error: {name}={env[name]!r} is not an integer {within}: the launcher (torchrun, srun) sets it; "
            "if you set it yourself, correct or unset it"
        )
    return int(value)


def check_environment(env=os.environ):
    """Every launcher variable the lesson reads (common/distributed.py launcher(), common/environment.py), before
    it reads them; and a launch that has none although the job has several tasks."""
    for name in ("SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE", "SLURM_STEP_NUM_NODES"):
        integer(name, None, env=env, low=1)
    if "RANK" in env:  # torchrun, or by hand
        integer("RANK", env=env), integer("LOCAL_RANK", env=env), integer("WORLD_SIZE", env=env, low=1)
        if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise SystemExit("error: RANK is set but MASTER_ADDR or MASTER_PORT is not: export both (rank 0's host "
                             "and a free port), or launch with torchrun")  # fmt: skip
        integer("MASTER_PORT", env=env, low=1, high=65535)
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # an srun task
        if not env.get("SLURM_JOB_NODELIST"):
            raise SystemExit("error: SLURM_JOB_NODELIST is not set in this srun task: launch it with srun in a job")
        check_hostlist(env["SLURM_JOB_NODELIST"])
        integer("SLURM_PROCID", env=env), integer("SLURM_LOCALID", env=env), integer("SLURM_NTASKS", env=env, low=1)
        integer("MASTER_PORT", None, env=env, low=1, high=65535) or integer("SLURM_JOB_ID", env=env)
    elif integer("SLURM_NTASKS", 1, env=env) > 1:
        raise SystemExit(
            f"error: this job has SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not one of its "
            "tasks (it runs in the batch script or an salloc shell): launch train.py with `srun python "
            "train.py`, or with torchrun"
        )


def check_hostlist(hostlist):
    """A hostlist distributed.expand_hostlist() can read: brackets that match, each holding numbers and ranges."""
    parts = [part for group in re.findall(r"\[([^\]]*)\]", hostlist) for part in group.split(",")]
    ranges = [re.fullmatch(r"(\d+)(?:-(\d+))?", part) for part in parts]
    if hostlist.count("[") != hostlist.count("]") or not all(r and int(r[2] or r[1]) >= int(r[1]) for r in ranges):
        raise SystemExit(
            f"error: cannot read the Slurm hostlist {hostlist!r}: set SLURM_JOB_NODELIST as Slurm writes it"
        )


def usage(message):
    """A usage error, as the parser reports one: one line from rank 0, exit status 2."""
    cli.say(f"error: {message} (see --help)")
    raise SystemExit(2)


def check_args(args, warn=True):
    """What the parser cannot see alone, then --check's exit. Rank 0 alone reads a checkpoint, and on nodes that
    share no filesystem only its node has the file: a --resume PATH that is no checkpoint is one line before
    anything starts (a FIFO would hang torch.load, a directory make it fail with a traceback)."""
    if cli.learning_rate(args) > cli.FLOAT32_MAX:
        usage(f"--lr {args.lr:g} scaled to --batch-size {args.batch_size} ({args.lr_scaling}) overflows float32")
    path = args.resume
    if isinstance(path, Path) and is_rank0() and not (path.is_file() or (path / "state.pt").is_file()):
        what = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        usage(f"argument --resume: {path} {what}: give a checkpoint file (<output-dir>/checkpoint.pt) or, from "
              "stage 05, a checkpoint folder (<output-dir>/checkpoint)")  # fmt: skip
    cpus = cpus_per_rank()
    if args.num_workers is not None and args.num_workers > cpus:
        if warn:
            cli.say(
                f"warning: --num-workers {args.num_workers} is more than the {cpus} CPUs per rank here: using {cpus}"
            )
        args.num_workers = cpus
    if args.check:  # the options hold for this stage: nothing else to do
        raise SystemExit(0)


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
        raise SystemExit(f"error: inconsistent launch: rank {rank}, local rank {local_rank}, world size {world_size}")
    if args.batch_size % world_size:  # every rank alike, so rank 0 alone says it; a resume keeps --batch-size
        # up to 1024 ranks: a divisor search over a typo's 10**12 would keep every rank busy for minutes
        sizes = ", ".join(str(n) for n in range(1, min(args.batch_size, 1024) + 1) if args.batch_size % n == 0)
        raise SystemExit(f"error: --batch-size {args.batch_size} is the global batch: it must divide by the world size "
                         f"{world_size}: run on {sizes} ranks" if rank == 0 else 1)  # fmt: skip


def check_cpu_options(args):
    if args.sync_bn:
        raise SystemExit("error: --sync-bn needs GPUs (PyTorch's SyncBatchNorm runs on CUDA only): drop it on CPUs")


def check_compile(args, device):
    """--compile needs what torch.compile generates code with: a C++ compiler for the CPU, Triton for GPUs."""
    if not getattr(args, "compile", False):  # the doctor's options have no --compile
        return
    import torch._dynamo  # here: a run without --compile never loads the compiler stack

    if not torch._dynamo.is_dynamo_supported():
        raise SystemExit(f"error: --compile: torch {torch.__version__} cannot compile on Python {sys.version.split()[0]}: "
                         "drop --compile, or use a Python this torch supports")  # fmt: skip
    if device.type == "cpu" and not any(
        shutil.which(cc) for cc in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")
    ):
        raise SystemExit(
            "error: --compile on the CPU needs a C++ compiler (g++) on PATH: `module load gcc`, or drop --compile"
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise SystemExit("error: --compile on GPUs needs Triton, which this torch lacks: `pip install triton` "
                         "(the version torch pins), or drop --compile")  # fmt: skip


def check_gpus(local_rank, visible):
    if visible > 1 and local_rank >= visible:
        raise SystemExit(
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
        raise SystemExit(
            f"error: {name}={wanted} but {socket.gethostname()} has no interface {', '.join(missing)} (it has "
            f"{', '.join(here)}): set it to the interface of the network the nodes share, or unset it"
        )


def defining(args):
    """{dest: value} of the options that define what a run computes (cli.DEFINING): plain values, for a
    checkpoint loaded with weights_only=True. A cosine schedule is defined by --epochs too: it decays to 0
    over them."""
    values = {name: getattr(args, name) for name in cli.DEFINING if hasattr(args, name)}
    values["task"] = args.task.name  # where the file lies may change; which task it is may not
    if args.scheduler == "cosine":
        values["epochs"] = args.epochs
    return values


def fingerprint(dataset, samples=1000):
    """A short string that differs when two ranks read different data: the image count and shape, and a hash
    of every label and of at most `samples` images evenly strided through the set. Sampled to be cheap: hashing
    all of CIFAR-100's 150 MB takes each rank a quarter of a second at every start, 1,000 images a few
    milliseconds; the sizes and labels, which a truncated, reordered or different file changes, go in whole."""
    digest = hashlib.blake2b(str(tuple(dataset.images.shape)).encode(), digest_size=8)
    digest.update(dataset.labels.numpy().tobytes())
    digest.update(dataset.images[:: max(math.ceil(len(dataset) / samples), 1)].numpy().tobytes())
    return f"{len(dataset)}-{digest.hexdigest()}"


def agree(args, *datasets):
    """Before the first step: every rank must train the same run on the same data. A difference in the
    options that define the run, or in the data sets' sizes or fingerprints, ends every rank with the
    option (or data set) and the ranks that differ, instead of a collective mismatch deep in torch."""
    if not dist.is_initialized():
        return
    mine = {f"--{k.replace('_', '-')}": v for k, v in defining(args).items()}
    mine.update({f"the {s.name} data ({len(s)} images here)": fingerprint(s) for s in datasets})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for key, value in everyone[0].items():
        differ = [f"rank {r}: {theirs.get(key)}" for r, theirs in enumerate(everyone) if theirs.get(key) != value]
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
