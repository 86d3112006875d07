"""The launcher's variables, read in one place and without torch (the job scripts' argument check imports
this): which rank this process is, how many CPUs it has, and every number checked. A variable that is
missing where the launch needs it, or set but not a number in range (a typo in a launch by hand, a
wrapper exporting garbage), is one line naming the variable and its value instead of a ValueError or
KeyError deep in the run."""

import os

REQUIRED = object()


def integer(name, default=REQUIRED, env=os.environ, low=0, high=None):
    """env[name] as an integer in [low, high]; `default` if it is unset or empty, or an error if required."""
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


def is_rank0(env=os.environ):
    """Is this global rank 0, the one that prints, writes and reads? torchrun (and a launch by hand) says so
    in RANK, srun in SLURM_PROCID; a process no launcher started is rank 0 of 1. Known before any process
    group exists, so that a usage error is printed once per job, not once per rank."""
    if "RANK" in env:  # torchrun; wins under `srun torchrun`, where SLURM_PROCID numbers the torchruns
        return env["RANK"] == "0"
    if "SLURM_STEP_ID" in env:  # an srun task (the batch shell has no step)
        return env.get("SLURM_PROCID") == "0"
    return True


def cpus_per_rank(env=os.environ):
    """The CPUs of this process: its Slurm task's (or those it may run on), shared by the ranks torchrun
    started beside it."""
    cpus = integer("SLURM_CPUS_PER_TASK", len(os.sched_getaffinity(0)), env=env, low=1)
    return max(cpus // integer("LOCAL_WORLD_SIZE", 1, env=env, low=1), 1)


def ranks_per_node(world_size, env=os.environ):
    """The ranks on each node: torchrun's LOCAL_WORLD_SIZE, else this srun step's ranks over its nodes; all of
    them on one node, or without a launcher."""
    if env.get("LOCAL_WORLD_SIZE"):
        return integer("LOCAL_WORLD_SIZE", env=env, low=1)
    return max(world_size // integer("SLURM_STEP_NUM_NODES", 1, env=env, low=1), 1)
