# SPDX-License-Identifier: BSD-3-Clause
"""sweeps/batch_size.slurm, unmodified, as a job array on the local cluster: a task per batch size."""

import contextlib
import csv
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, TRAIN_SIZE

pytestmark = pytest.mark.slurm


def test_batch_size_sweep(slurm_cluster, tiny_data):
    """Two array tasks (--array=0-1: batch sizes 32 and 64) complete, each with its own log,
    %x-%A_%a.out, and its own runs/batch_size/<array job id>/bs<value>/metrics.csv."""
    # Held until its output folder is known to be free: job ids start again at 1 with every cluster.
    opts = ["--array=0-1", "--hold"]
    job_id = slurm_cluster.submit(
        REPO / "sweeps/batch_size.slurm", "--data-dir", tiny_data, "--epochs", 1, sbatch_opts=opts
    )
    runs = REPO / "runs/batch_size" / job_id
    tasks = {f"{job_id}_0": 32, f"{job_id}_1": 64}  # `scontrol show job <id>_<index>`: one task, pending or not
    logs = {task: Path(slurm_cluster.job_info(task)["StdOut"]) for task in tasks}
    try:
        shutil.rmtree(runs, ignore_errors=True)
        subprocess.run(["scontrol", "release", job_id], check=True)
        for task, bs in tasks.items():
            info = slurm_cluster.wait(task)
            output = logs[task].read_text()
            assert logs[task] == REPO / f"sweeps/batch_size-{task}.out"
            assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
            assert f" batch 0/{TRAIN_SIZE // bs} " in output, output  # this task's batch size
            rows = list(csv.DictReader(open(runs / f"bs{bs}" / "metrics.csv")))
            assert [row["epoch"] for row in rows] == ["1"]
        assert sorted(p.name for p in runs.iterdir()) == ["bs32", "bs64"]
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)  # if a check failed before the end
        for log in logs.values():
            log.unlink(missing_ok=True)
        shutil.rmtree(runs, ignore_errors=True)
        with contextlib.suppress(OSError):
            runs.parent.rmdir()  # runs/batch_size, unless other sweeps are there
