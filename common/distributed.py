"""Who am I, where do I run, who are my peers: one answer for python, torchrun and srun.

`setup()` returns `rank, local_rank, world_size, device` in every case, so the training code never
branches on how it was launched. A process group exists whenever a launcher started the process
(torchrun, or srun with one task per GPU); a plain `python train.py` is rank 0 of 1 without one.

The launchers say who is who in environment variables: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; srun sets SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS, and the address
and port follow from the job (its first node, and a port from its id); common/environment.py's
launcher() reads them, once for every module. setup() meets the other ranks there: rank 0 serves a
key-value store at that address and port (torchrun's agent, where it shares its own), the others
connect, and each process writes how to reach it. The guard rails attach from outside
(common/guards/): they check the launch before the rendezvous and watch it as a second client of
the same store, to bound every wait and name the rank that did not come or went silent.
"""

import ctypes
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

from common.environment import is_rank0, launcher, ranks_per_node


def setup(args):
    """Pick the device, join the process group: returns rank, local_rank, world_size, device.
    The ranks meet at rank 0's address and port, MASTER_ADDR:MASTER_PORT under torchrun."""
    launch = launcher()
    device = use_device(launch.local_rank, args)
    if launch.addr:  # a launcher started this process: meet the others
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",  # NCCL between GPUs, gloo between CPUs
            init_method=f"tcp://{launch.addr}:{launch.port}",  # rank 0 serves a store there
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=args.dist_timeout),  # how long a collective may wait
            device_id=device if device.type == "cuda" else None,
        )
    return launch.rank, launch.local_rank, launch.world_size, device


def mesh(args, world_size, device):
    """Stage 05's DeviceMesh, or None without a process group. On several nodes 2-D (HSDP): the
    weights sharded within a node, whose fast links carry the all-gathers, and replicated across
    nodes, where only the gradients' all-reduce goes. Else (or --full-shard) 1-D: FSDP."""
    if not dist.is_initialized():
        return None
    if device.type == "cpu" and sys.platform == "linux":  # glibc keeps what FSDP frees each step:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD 1 MiB: each unmapped when freed
    from torch.distributed.device_mesh import init_device_mesh  # here: only stage 05 imports it

    everyone = [None] * world_size  # torchruns of unequal --nproc_per_node: one mesh for all ranks
    dist.all_gather_object(everyone, ranks_per_node(world_size))
    per_node = everyone[0]
    if args.full_shard or len(set(everyone)) > 1 or per_node >= world_size or world_size % per_node:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    shape, names = (world_size // per_node, per_node), ("replicate", "shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def use_device(local_rank, args):
    """This rank's device, made current: GPU `local_rank` (0 if the task sees one), or the CPU."""
    if not torch.cuda.is_available() or args.no_cuda:
        return torch.device("cpu")
    device = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
    torch.cuda.set_device(device)
    return device


def cleanup():
    """Leave the process group together (torch < 2.8 deadlocks destroying a gloo group in use)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def average_buffers(model):
    """Average the model's floating-point buffers (BatchNorm's running statistics) over the ranks
    in one all-reduce: each rank updates its own from its batches (FSDP shards no buffer; DDP
    broadcasts rank 0's before its next forward): all evaluate, and checkpoints save, the same."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not dist.is_initialized() or not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).float() for b in buffers])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for b, average in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
        b.copy_(average.view_as(b))


def print0(*args):
    """Print from global rank 0 only; flush so batch logs show progress as it happens."""
    if is_rank0():
        print(*args, flush=True)


def banner(args, rank, local_rank, world_size, device, loader):
    """Each log's head: what ran, where and how (a sweep's logs tell apart), then who runs where."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "none"
    workers = getattr(loader, "num_workers", 0)
    print0(f"torch {torch.__version__} | device {device.type} | world size {world_size}")
    print0(f"job {job} | loader {args.loader}, {workers} workers | output {args.output_dir}")
    print0(f"options: {' '.join(sys.argv[1:]) or '(the defaults)'}")
    here = (rank, local_rank, os.environ.get("SLURMD_NODENAME", socket.gethostname()), str(device))
    everyone = [here] * world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, here)
    for r, lr, host, dev in everyone:
        print0(f"  rank {r} | local rank {lr} | host {host} | device {dev}")
