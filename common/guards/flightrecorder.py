"""Guard rail: a hang you can read afterwards. torch's flight recorder keeps each rank's last NCCL collectives in a
ring buffer and, when one outlasts --dist-timeout, dumps them to <prefix><rank>. Run as
`python -m common.guards.flightrecorder ARGS...` in a job script, in the stage's folder, it prints the `export` line
that switches the recorder on (variables()) with that prefix in the run's folder, where ARGS put it (--output-dir,
or its default for the job's first srun step, which starts the ranks): the job script evaluates it. torchfrtrace
reads the dumps (README, Troubleshooting)."""

import argparse
import os
import shlex
import sys
from pathlib import Path

from common import cli
from common.guards import versions

FILES = "flight-recorder-rank-"  # the dumps' names less the rank: torchfrtrace's --prefix
ENTRIES = "2000"  # collectives kept per rank: torch's suggestion, a few steps of the stages


def prefix(output_dir):
    """Where each rank's dump goes, less its rank: in the run's folder, which exists before any collective."""
    return f"{Path(output_dir).absolute()}/{FILES}"


def output_dir(argv, script=Path("train.py"), env=os.environ):
    """The run's folder of a stage given `argv`, in the job's first step. Options are train.py's to check: a
    usage error here gives the default folder and no line, and the ranks say it once, as for any other option."""
    first_step = {**env, "SLURM_STEP_ID": "0"}  # the batch shell has no step; srun's first is 0, after a requeue too
    default = cli.default_output_dir(script.resolve(), first_step)
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    p.add_argument("--output-dir", type=Path, default=default)
    try:
        return p.parse_known_args(argv)[0].output_dir
    except argparse.ArgumentError:
        return default


def variables(prefix, torch_version=None):
    """What switches the recorder on, dumping to `prefix`<rank> on a timeout, in the names the torch this Python
    imports reads (versions.installed(), without importing it): TORCH_FR_ from 2.9, which warns of the older
    TORCH_NCCL_ ones in every rank's log; those before (2.7, stages 03-04's oldest)."""
    version = torch_version or versions.installed() or "0"
    if versions.release(version) >= (2, 9):
        return {"TORCH_FR_BUFFER_SIZE": ENTRIES, "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": ENTRIES,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


def exports(argv):
    """The shell line that exports variables() for a stage given `argv`."""
    found = variables(prefix(output_dir(argv)))
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in found.items())


if __name__ == "__main__":
    print(exports(sys.argv[1:]))
