"""Who am I, where do I run, who are my peers: one answer for python, torchrun and srun.

`setup()` returns `rank, local_rank, world_size, device` in every case, so the training code never
branches on how it was launched. A process group exists whenever a launcher started the process
(torchrun, or srun with one task per GPU); a plain `python train.py` is rank 0 of 1 without one.
"""

import datetime
import os
import re
import socket

import torch
import torch.distributed as dist


def expand_hostlist(hostlist):
    """Expand a Slurm hostlist ("node[01-03,07],gpu5") in Python: `scontrol` is not always there."""
    hosts = []
    for prefix, ranges, suffix, plain in re.findall(r"([^,\[]*)\[([^\]]+)\]([^,\[]*)|([^,\[\]]+)", hostlist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")  # keep zero padding: node01, not node1
    return hosts


def master_port(job_id):
    """A port derived from the job id, so two jobs sharing a node do not collide (also in job scripts)."""
    return 20000 + int(job_id) % 40000


def launcher_env(env=os.environ):
    """Read rank, local rank and world size from the launcher's variables, or fail with the fix."""
    if "RANK" in env:  # torchrun; wins over Slurm's variables under `srun torchrun`
        return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]), True
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # an srun task (the batch shell has no step)
        env.setdefault("MASTER_ADDR", expand_hostlist(env["SLURM_JOB_NODELIST"])[0])
        env.setdefault("MASTER_PORT", str(master_port(env["SLURM_JOB_ID"])))
        return int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]), int(env["SLURM_NTASKS"]), True
    if int(env.get("SLURM_NTASKS", 1)) > 1:
        raise SystemExit(
            f"error: this job has SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not one of its "
            "tasks (it runs in the batch script or an salloc shell): launch train.py with `srun python "
            "train.py`, or with torchrun"
        )
    return 0, 0, 1, False


def setup(args):
    """Check the launch, pick the device, join the process group: returns rank, local_rank, world_size, device."""
    rank, local_rank, world_size, launched = launcher_env()
    if not (0 <= rank < world_size and 0 <= local_rank <= rank):
        raise SystemExit(f"error: inconsistent launch: rank {rank}, local rank {local_rank}, world size {world_size}")
    if args.batch_size % world_size:
        raise SystemExit(
            f"error: --batch-size {args.batch_size} is the global batch: it must divide by the world size {world_size}"
        )
    if torch.cuda.is_available() and not args.no_cuda:
        visible = torch.cuda.device_count()
        if visible > 1 and local_rank >= visible:
            raise SystemExit(
                f"error: local rank {local_rank} but only {visible} GPUs are visible on {socket.gethostname()}: "
                "ask Slurm for as many tasks per node as GPUs per node (--ntasks-per-node = --gpus-per-node)"
            )
        device = torch.device("cuda", local_rank if visible > 1 else 0)  # one visible GPU per task: it is 0
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launched:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=args.dist_timeout),
            device_id=device if device.type == "cuda" else None,
        )
    return rank, local_rank, world_size, device


def cleanup():
    if dist.is_initialized():
        dist.destroy_process_group()


def print0(*args):
    """Print from global rank 0 only; flush so batch logs show progress as it happens."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def banner(rank, local_rank, world_size, device):
    """One start-up banner: versions, and the rank <-> host <-> device map, the first thing to read when a job hangs."""
    cuda = torch.version.cuda if torch.cuda.is_available() else "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    print0(f"torch {torch.__version__} | CUDA {cuda} | NCCL {nccl} | device {device.type} | world size {world_size}")
    here = (rank, local_rank, os.environ.get("SLURMD_NODENAME", socket.gethostname()), str(device))  # Slurm's name
    everyone = [here] * world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, here)
    for r, lr, host, dev in everyone:
        print0(f"  rank {r} | local rank {lr} | host {host} | device {dev}")
