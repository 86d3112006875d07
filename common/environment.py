"""Guard rail: the numbers launchers pass in environment variables (torchrun: RANK, LOCAL_RANK, ...; srun:
SLURM_PROCID, SLURM_NTASKS, ...), read in one place. One that is missing where the launch needs it, or
set but not a number in range (a typo in a launch by hand, a wrapper exporting garbage), is one line
naming the variable and its value, instead of a ValueError or KeyError deep in the run."""

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
