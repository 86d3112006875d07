# SPDX-License-Identifier: BSD-3-Clause
"""tools/doctor.slurm, unmodified, on the local cluster's two nodes x two tasks: it passes, and what
differs between the nodes (a loopback MASTER_ADDR, node-local data or output) is named by node."""

import json
import shutil
import time
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.slurm
SCRIPT = REPO / "tools" / "doctor.slurm"


def doctor(cluster, *args, env=None):
    """sbatch the doctor with `args`, wait; returns the job's fields, its log and the seconds it took."""
    start = time.monotonic()
    job_id = cluster.submit(SCRIPT, *args, env=env)
    log = Path(cluster.job_info(job_id)["StdOut"])
    try:
        info = cluster.wait(job_id)
        return info, log.read_text(), time.monotonic() - start
    finally:
        log.unlink(missing_ok=True)


def verdicts(output):
    return {status: [line for line in output.splitlines() if line.startswith(status)] for status in ("PASS", "FAIL")}


def netns(cluster):
    if cluster.mode() != "netns":
        pytest.skip("the cluster runs in loopback mode: its nodes share one network and hostname")


def test_the_doctor_passes_on_two_nodes(slurm_cluster, tmp_path):
    """No FAIL; the table names both nodes, the first node's own address as MASTER_ADDR, each node's
    eth0, bandwidths within and across nodes, and the job's requeue settings."""
    info, output, _ = doctor(slurm_cluster, "--data-dir", REPO / "data", "--output-dir", tmp_path)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    lines = verdicts(output)
    assert not lines["FAIL"], output
    assert "doctor: 4 ranks on 2 nodes, cpu, job " in output, output
    checks = [c["check"] for c in json.loads((tmp_path / "doctor.json").read_text())["checks"]]
    assert {"busbw within nodes", "busbw across nodes", "requeue"} <= set(checks) and len(checks) == 22
    assert any("node1 (ranks 0, 1), node2 (ranks 2, 3)" in line for line in lines["PASS"]), output
    assert any("Requeue=1, --signal=B:USR1@90" in line for line in lines["PASS"]), output
    assert any("shared by every node" in line for line in lines["PASS"]), output
    if slurm_cluster.mode() == "netns":
        assert any("node1 = 10.213.48.11 on every rank" in line for line in lines["PASS"]), output
        assert any("node1: eth0 10.213.48.11" in line and "node2: eth0 10.213.48.12" in line for line in lines["PASS"])


def test_a_loopback_master_addr_on_two_nodes_is_named(slurm_cluster, tmp_path):
    """MASTER_ADDR=localhost for a job on two nodes: the ranks on node2 would wait for a rank 0 on their own
    node. They say so at once, naming the address, and srun ends the step: no wait for --dist-timeout."""
    netns(slurm_cluster)
    args = ["--data-dir", REPO / "data", "--output-dir", tmp_path, "--dist-timeout", 30]
    info, output, seconds = doctor(slurm_cluster, *args, env={"MASTER_ADDR": "localhost"})
    assert info["JobState"] == "FAILED" and seconds < 30, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and "Traceback" not in output, output
    assert all("on node2: MASTER_ADDR localhost is 127.0.0.1, a loopback address" in e for e in errors), errors
    assert {e.split()[2] for e in errors} <= {"2", "3"}, errors


def test_data_and_output_folder_that_differ_on_one_node_are_named(slurm_cluster):
    """Node-local folders (the cluster's SCRATCH, each node's own, as node-local disk is): node1 has MNIST
    and can write the output folder; node2 lacks one MNIST file and has a file where the folder should
    be. Both are FAIL lines naming ranks 2 and 3 on node2; rank 0 writes doctor.json on node1."""
    netns(slurm_cluster)
    nodes = slurm_cluster.DIR / "nodes"
    try:
        for node in ("node1", "node2"):
            shutil.copytree(REPO / "data/MNIST/raw", nodes / node / "data/MNIST/raw",
                            ignore=shutil.ignore_patterns("*.gz"))  # fmt: skip
        (nodes / "node2/data/MNIST/raw/train-labels-idx1-ubyte").unlink()
        (nodes / "node2/out").touch()
        scratch = slurm_cluster.SCRATCH
        info, output, _ = doctor(slurm_cluster, "--data-dir", scratch / "data", "--output-dir", scratch / "out")
        assert info["JobState"] == "FAILED", output
        failed = verdicts(output)["FAIL"]
        assert len(failed) == 2, output
        data, out = failed
        assert all(f"rank {r} (node2): cannot load it (" in data for r in (2, 3)), data
        assert "(missing train-labels-idx1-ubyte)" in data, data
        assert "node1" not in data
        said = "out is a file, or inside one, not a folder"  # as the stages say it: it said "cannot write"
        assert all(f"rank {r} (node2): " in out for r in (2, 3)) and said in out and "node1" not in out, out
        checks = json.loads((nodes / "node1/out/doctor.json").read_text())["checks"]
        assert [c["status"] for c in checks if c["check"] in ("data", "output folder")] == ["FAIL", "FAIL"]
    finally:
        for node in ("node1", "node2"):
            shutil.rmtree(nodes / node / "data", ignore_errors=True)
            shutil.rmtree(nodes / node / "out", ignore_errors=True)
        (nodes / "node2/out").unlink(missing_ok=True)
