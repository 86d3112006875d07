"""The launcher's variables, read in one place and without torch: which rank this process is and how many
CPUs it has. (The guard rails check every variable first: common/guards/preflight.py.)"""

import os


def is_rank0(env=os.environ):
    """Is this global rank 0, the one that prints, writes and reads? Known from the launcher's variables before
    any process group exists, so that a usage error is printed once per job; no launcher: rank 0 of 1."""
    if "RANK" in env:  # torchrun; wins under `srun torchrun`, where SLURM_PROCID numbers the torchruns
        return env["RANK"] == "0"
    if "SLURM_STEP_ID" in env:  # an srun task (the batch shell has no step)
        return env.get("SLURM_PROCID") == "0"
    return True


def cpus_per_rank(env=os.environ):
    """The CPUs of this process: its Slurm task's (or those it may use), shared with torchrun's other ranks."""
    cpus = int(env.get("SLURM_CPUS_PER_TASK") or len(os.sched_getaffinity(0)))
    return max(cpus // int(env.get("LOCAL_WORLD_SIZE") or 1), 1)


def ranks_per_node(world_size, env=os.environ):
    """The ranks on each node: torchrun's LOCAL_WORLD_SIZE, else this srun step's ranks over its nodes."""
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    return max(world_size // int(env.get("SLURM_STEP_NUM_NODES") or 1), 1)
