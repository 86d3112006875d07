# SPDX-License-Identifier: BSD-3-Clause
"""Stage 05's job script under the real local Slurm: four ranks on two nodes, and the same job requeued
onto one node mid-epoch, where it resumes its sharded checkpoint at world size 2 at the same sample."""

import csv
import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import INJECT, REPO, TRAIN_SIZE
from test_job_scripts import check_completed, check_two_nodes, lines, sbatch

pytestmark = pytest.mark.slurm


def test_stage05_job_script(slurm_cluster, tiny_data, tmp_path):
    _, info, output = sbatch(slurm_cluster, "05_fsdp/job.slurm", tiny_data, tmp_path / "out")
    check_completed(info, output, tmp_path / "out", world_size=4)
    check_two_nodes(info, output)
    assert "mesh: 2 nodes (replicate) x 2 ranks (shard)" in output  # HSDP: sharded within a node
    assert os.readlink(tmp_path / "out" / "checkpoint") == "epoch-1"


def scontrol(*args):
    subprocess.run(["scontrol", *args], check=True, capture_output=True)


def test_requeued_onto_fewer_nodes_mid_epoch_resumes_at_the_same_sample(slurm_cluster, tiny_data, tmp_path):
    """What a preempted job that comes back on a smaller allocation does: two steps into epoch 2 the job is
    requeued and held (SIGTERM: the ranks save mid-epoch), cut to one node, released; it resumes at world
    size 2 at the step where it stopped, finishes, and trains on every sample once per epoch."""
    out, record = tmp_path / "out", tmp_path / "batches.jsonl"
    args = ["--data-dir", tiny_data, "--epochs", 3, "--batch-size", 32, "--output-dir", out]
    slow = dict(PYTHONPATH=INJECT, FAULT_RANK="0", FAULT_SLEEP="0.3", RECORD_BATCHES=str(record))
    job_id = slurm_cluster.submit(REPO / "05_fsdp/job.slurm", *args, env=slow)
    log = Path(slurm_cluster.job_info(job_id)["StdOut"])
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.csv").exists() and "\n1," in (out / "metrics.csv").read_text()):
            assert time.monotonic() < deadline, "no epoch 1"
            time.sleep(0.1)
        time.sleep(0.7)
        scontrol("requeuehold", job_id)
        scontrol("update", f"JobId={job_id}", "NumNodes=1", "NumTasks=2", "NumCPUs=8")  # 2 tasks x 4 CPUs
        scontrol("release", job_id)
        info = slurm_cluster.wait(job_id, timeout=300)
        output = log.read_text()
    finally:
        log.unlink(missing_ok=True)
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node1"), output
    assert [line.split("| world size ")[1] for line in lines(output, "torch ")] == ["4", "2"], output
    [saved] = lines(output, "saved at epoch 2, step ")
    step = saved.split("step ")[1].split(":")[0]
    [resumed] = lines(output, "resumed at epoch 2, step ")
    assert resumed.startswith(f"resumed at epoch 2, step {step} (Slurm restart 1,"), resumed
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]  # every epoch once
    assert [int(row["world_size"]) for row in rows] == [4, 2, 2]
    batches = [json.loads(line) for line in record.read_text().splitlines()]
    seen = Counter(i for b in batches if b["size"] == TRAIN_SIZE for i in b["indices"])
    assert seen == Counter({i: 3 for i in range(TRAIN_SIZE)})  # three epochs: each image three times
