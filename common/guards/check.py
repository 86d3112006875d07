"""A job script's check before torchrun starts its workers: `python -m common.guards.check ARGS...` checks ARGS
as the stage in this folder would, without importing torch, and a torch too old for that stage: a usage error
ends the job once, not once per worker and restart. Silent on success (the workers print any warning)."""

import sys
from pathlib import Path

from common import cli
from common.guards import preflight, versions

if __name__ == "__main__":
    versions.require(Path("train.py"))  # job scripts run in the stage's folder
    preflight.check_args(cli.parse_args(sys.argv[1:])[0], warn=False)
