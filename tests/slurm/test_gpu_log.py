# SPDX-License-Identifier: BSD-3-Clause
"""The job scripts' GPU log: nvidia-smi in the background while the step runs, stopped by its PID
when the script ends, whether the step succeeded or failed; no log at all where there is no nvidia-smi."""

import os
import shutil
import time
from pathlib import Path

import pytest
from helpers import REPO, processes_with

pytestmark = pytest.mark.slurm
SCRIPT = REPO / "01_single_gpu/job.slurm"  # the block is the same text in every job script
FAKE_NVIDIA_SMI = """#!/bin/sh
# nvidia-smi's CSV, a row every 0.2 s until it is stopped; says how it was started and stopped.
echo "nvidia-smi $*" >&2
trap 'echo "nvidia-smi: stopped by SIGTERM" >&2; exit 0' TERM
echo "timestamp, index, utilization.gpu [%], memory.used [MiB]"
while :; do echo "$(date '+%Y/%m/%d %H:%M:%S.000'), 0, 42 %, 1000 MiB"; sleep 0.2 & wait $!; done
"""


def run_job(cluster, tiny_data, tmp_path, epochs, path=None):
    """sbatch the script (PATH set to `path`), wait for it; returns its id, fields, log, GPU log file."""
    env = {"PATH": path} if path else None
    job_id = cluster.submit(
        SCRIPT, "--data-dir", tiny_data, "--epochs", epochs, "--output-dir", tmp_path / "out", env=env
    )
    log = Path(cluster.job_info(job_id)["StdOut"])
    try:
        info = cluster.wait(job_id)
        return job_id, info, log.read_text(), log.with_suffix(".gpu.csv")
    finally:
        log.unlink(missing_ok=True)


@pytest.mark.parametrize("epochs, state", [(1, "COMPLETED"), (0, "FAILED")])  # --epochs 0 is refused
def test_gpu_log_runs_with_the_step_and_stops_with_the_script(slurm_cluster, tiny_data, tmp_path, epochs, state):
    fake = tmp_path / "bin/nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    path = f"{fake.parent}:{os.environ['PATH']}"
    job_id, info, output, gpu_csv = run_job(slurm_cluster, tiny_data, tmp_path, epochs, path=path)
    try:
        assert info["JobState"] == state, output
        assert "nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 5" in output
        assert "nvidia-smi: stopped by SIGTERM" in output  # by the script: Slurm's own clean-up uses SIGKILL
        assert gpu_csv.name == f"01_single_gpu-{job_id}.gpu.csv"  # beside the log
        header, *rows = gpu_csv.read_text().splitlines()
        assert header.startswith("timestamp, index") and rows and all(r.endswith("42 %, 1000 MiB") for r in rows)
        deadline = time.monotonic() + 3
        while processes_with(f"SLURM_JOB_ID={job_id}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with(f"SLURM_JOB_ID={job_id}") == []  # nothing of the job is left, the logger included
    finally:
        gpu_csv.unlink(missing_ok=True)


def test_no_gpu_log_without_nvidia_smi(slurm_cluster, tiny_data, tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    job_id, info, output, gpu_csv = run_job(slurm_cluster, tiny_data, tmp_path, epochs=1)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert "nvidia-smi" not in output and not gpu_csv.exists()
