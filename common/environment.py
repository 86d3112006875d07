"""The launcher's variables, read in one place and without torch: which rank this process is, where
the ranks meet, and how many CPUs it has. launcher() is the one reading of them: is_rank0(), the
process group and the guard rails all take it from there, so no two modules can disagree on who rank
0 is. (The guard rails refuse a missing or malformed variable first: common/guards/check.py.)"""

import os
import re
from typing import NamedTuple


class Launch(NamedTuple):
    rank: int
    local_rank: int
    world_size: int
    addr: str = None  # rank 0's host and port, where the ranks meet; None without a launcher
    port: int = None


def count(text):
    """A launcher variable as a count: ASCII digits, blanks ignored ("00" is 0); else None."""
    return int(text) if re.fullmatch(r"\s*[0-9]+\s*", text or "") else None


def first_host(hostlist):
    """The first host of a Slurm hostlist, where the ranks meet: "node[07-09,12],gpu1" -> node07,
    as `scontrol show hostnames` lists it first (each bracket group's first number, zero-padded)."""
    first = re.search(r"(?:[^,\[]|\[[^\]]*\])+", hostlist or "")  # to a comma outside brackets
    return first and re.sub(r"\[([0-9]*)[^\]]*\]", r"\1", first[0])


def master_port(job_id):
    """A port from the job id: two jobs on a node do not collide. job_torchrun.slurm repeats it."""
    return 20000 + job_id % 40000


def launcher(env=os.environ):
    """This process's Launch from its launcher's variables; a missing or bad count is None."""
    if "RANK" in env:  # torchrun; wins over Slurm's variables under `srun torchrun`
        ranks = count(env["RANK"]), count(env.get("LOCAL_RANK")), count(env.get("WORLD_SIZE"))
        return Launch(*ranks, env.get("MASTER_ADDR") or None, count(env.get("MASTER_PORT")))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # an srun task (the batch shell: no step)
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST"))
        port = count(env.get("MASTER_PORT")) or master_port(count(env.get("SLURM_JOB_ID")) or 0)
        ranks = (count(env.get(k)) for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))
        return Launch(*ranks, addr, port)
    return Launch(0, 0, 1)


def restarts(env=os.environ):
    """(Slurm's requeues of this job, torchrun's restarts of its workers): 0, 0 at first."""
    slurm, torchrun = env.get("SLURM_RESTART_COUNT"), env.get("TORCHELASTIC_RESTART_COUNT")
    return count(slurm) or 0, count(torchrun) or 0


def is_rank0(env=os.environ):
    """Is this global rank 0, which prints, writes and reads? Known before any process group."""
    return launcher(env).rank == 0


def cpus_per_rank(env=os.environ):
    """This process's CPUs: its Slurm task's (or what it may use), shared by torchrun's ranks; no
    more than it may use (an srun step given fewer than --cpus-per-task: no SRUN_CPUS_PER_TASK)."""
    mine = len(os.sched_getaffinity(0))
    cpus = count(env.get("SLURM_CPUS_PER_TASK")) or mine
    return max(min(cpus // (count(env.get("LOCAL_WORLD_SIZE")) or 1), mine), 1)


def nodes(env=os.environ):  # the run's: torchrun's agents (one a node), else its srun step's
    return count(env.get("GROUP_WORLD_SIZE")) or count(env.get("SLURM_STEP_NUM_NODES")) or 1


def ranks_per_node(world_size, env=os.environ):
    """The ranks on each node: torchrun's LOCAL_WORLD_SIZE, else this srun step's over its nodes."""
    return count(env.get("LOCAL_WORLD_SIZE")) or max(world_size // nodes(env), 1)
