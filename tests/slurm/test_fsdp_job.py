# SPDX-License-Identifier: BSD-3-Clause
"""Stage 05's job script under the real local Slurm: four ranks on two nodes, and the same job requeued
onto one node, where it resumes its sharded checkpoint at world size 2."""

import csv
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO
from test_job_scripts import check_completed, check_two_nodes, lines, sbatch

pytestmark = pytest.mark.slurm


def test_stage05_job_script(slurm_cluster, tiny_data, tmp_path):
    _, info, output = sbatch(slurm_cluster, "05_fsdp/job.slurm", tiny_data, tmp_path / "out")
    check_completed(info, output, tmp_path / "out", world_size=4)
    check_two_nodes(info, output)
    assert os.readlink(tmp_path / "out" / "checkpoint") == "epoch-1"


def scontrol(*args):
    subprocess.run(["scontrol", *args], check=True, capture_output=True)


def test_requeued_onto_fewer_nodes_resumes_at_the_new_world_size(slurm_cluster, tiny_data, tmp_path):
    """What a preempted job that comes back on a smaller allocation does: after its first checkpoint the
    job is requeued and held, cut to one node, released; it resumes at world size 2 and finishes."""
    out, epochs = tmp_path / "out", 20
    args = ["--data-dir", tiny_data, "--epochs", epochs, "--output-dir", out]
    job_id = slurm_cluster.submit(REPO / "05_fsdp/job.slurm", *args)
    log = Path(slurm_cluster.job_info(job_id)["StdOut"])
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint").exists():
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
        scontrol("requeuehold", job_id)
        scontrol("update", f"JobId={job_id}", "NumNodes=1", "NumTasks=2", "NumCPUs=8")  # 2 tasks x 4 CPUs
        scontrol("release", job_id)
        info = slurm_cluster.wait(job_id, timeout=300)
        output = log.read_text()
    finally:
        log.unlink(missing_ok=True)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node1"), output
    assert [line.split("| world size ")[1] for line in lines(output, "torch ")] == ["4", "2"], output
    [resumed] = lines(output, "resumed after epoch ")
    assert "(Slurm restart 1," in resumed, resumed
    done = int(resumed.split()[3])
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(row["epoch"]) for row in rows] == list(range(1, epochs + 1))  # every epoch once
    assert [int(row["world_size"]) for row in rows] == [4] * done + [2] * (epochs - done)
