"""Guard rail: a launch that can work, checked before setup() so that it ends in seconds with one line naming the
fix, instead of a hang or an error deep in torch: numbers that fit together, a device that exists and suits the
options (--sync-bn, stage 05's --amp, what --compile needs), and the network interfaces the options name."""

import importlib.util
import os
import shutil
import socket
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.environment import count
from common.guards.ending import Refusal
from common.options import amp, large


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
        raise Refusal(
            f"error: inconsistent launch: rank {rank}, local rank {local_rank}, world size {world_size}: "
            "the launcher sets them (rank < world size, local rank <= rank): set by hand, correct them"
        )
    if args.batch_size % world_size:  # every rank alike, so rank 0 alone says it; a resume keeps --batch-size
        # up to 1024 ranks: a divisor search over a typo's 10**12 would keep every rank busy for minutes
        sizes = ", ".join(str(n) for n in range(1, min(args.batch_size, 1024) + 1) if args.batch_size % n == 0)
        raise Refusal(
            f"error: --batch-size {args.batch_size} is the global batch: it must divide by the world size "
            f"{world_size}: run on {sizes} ranks",
            once=True,
        )
    per_rank, n = args.batch_size // world_size, getattr(args, "grad_accum", 1)
    slices = large.chunk(torch.empty(per_rank), n) if n > 1 else ()  # stage 05's own slicing (4 in 3: 2 of 2)
    if slices and len(slices) != n and rank == 0:
        print(
            f"warning: --grad-accum {n} does not split the {per_rank} images each rank computes per step: each "
            f"rank runs {len(slices)} micro-batches of at most {len(slices[0])}",
            flush=True,
        )
    check_amp(args, launch)
    check_restarts()


def check_restarts(env=os.environ):
    """torchrun on several nodes that restarts failed workers (--max-restarts) shares its rendezvous store with them
    unless told not to, and each node counts its restarts: after one node's workers failed, that node's attempt 1
    met the other's attempt 0 again, in the keys the first attempt left (its ranks' claims, torch's addresses:
    pytorch#135712), and the restart failed. Refused before the first attempt, not at the restart hours later."""
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and (count(env.get("GROUP_WORLD_SIZE")) or 1) > 1 and count(env.get("TORCHELASTIC_MAX_RESTARTS")):
        raise Refusal(
            "error: torchrun on several nodes with --max-restarts shares its store with the workers across restarts, "
            "which the nodes count apart (pytorch#135712): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before "
            "torchrun, as 04_ddp_multi_node/job_torchrun.slurm does",
            once=True,
        )


def check_amp(args, launch):
    """Stage 05's --amp is FSDP's mixed precision (amp.policies()), in bf16: refused, never ignored, where there
    is no FSDP to use it or no bf16 (fp16 would need a sharded loss scaler). Stage 05 alone has --full-shard."""
    if not (getattr(args, "amp", False) and hasattr(args, "full_shard")):
        return
    if not launch.addr:  # no launcher: no process group, nothing is sharded
        raise Refusal(
            "error: --amp in stage 05 is FSDP's mixed precision, which a plain `python train.py` does "
            "not use: launch with torchrun or srun (one GPU: torchrun --standalone --nproc_per_node=1 "
            "train.py --amp)"
        )
    if torch.cuda.is_available() and not args.no_cuda and amp.dtype(torch.device("cuda")) != torch.bfloat16:
        raise Refusal(
            "error: --amp in stage 05 computes in bf16, which this GPU lacks (fp16 would need a "
            "sharded loss scaler): drop --amp, or use stage 04 with --amp"
        )


def check_cpu_options(args):
    if args.sync_bn:
        raise Refusal("error: --sync-bn needs GPUs (PyTorch's SyncBatchNorm runs on CUDA only): drop it on CPUs")


def check_compile(args, device):
    """--compile needs what torch.compile generates code with: a C++ compiler for the CPU, Triton for GPUs."""
    if not getattr(args, "compile", False):  # the doctor's options have no --compile
        return
    import torch._dynamo  # here: a run without --compile never loads the compiler stack

    if not torch._dynamo.is_dynamo_supported():
        raise Refusal(
            f"error: --compile: torch {torch.__version__} cannot compile on Python {sys.version.split()[0]}: "
            "drop --compile, or use a Python this torch supports"
        )
    if device.type == "cpu" and not any(
        shutil.which(cc) for cc in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")
    ):
        raise Refusal(
            "error: --compile on the CPU needs a C++ compiler (g++) on PATH: `module load gcc`, or drop --compile"
        )
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise Refusal(
            "error: --compile on GPUs needs Triton, which this torch lacks: `pip install triton` "
            "(the version torch pins), or drop --compile"
        )


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


def check_split(model, sharded):
    """A launch of several ranks whose stage trains one whole copy of the model per process (01, 02: no DDP, no
    FSDP): each rank trained the whole data set alone, and the lines and metrics.csv said world size N, at 1/N of
    the speed per process. One line before the first step: each stage is launched as its job script does."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    if n > 1 and not sharded and not isinstance(model, DistributedDataParallel):
        raise Refusal(  # every rank's verdict: rank 0 says it
            f"error: this stage trains one copy of the model in one process, and {n} ranks were launched: each "
            f"would train the whole data set alone: run it as one process (python, or srun with one task), or "
            f"stage 03 for {n}",
            once=True,
        )
