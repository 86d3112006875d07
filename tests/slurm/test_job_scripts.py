# SPDX-License-Identifier: BSD-3-Clause
"""Every stage's job script, unmodified, `sbatch`ed to the local Slurm cluster on the tiny MNIST.

The cluster's GPUs are fake (torch sees none), so the runs are on the CPU with gloo; what is tested
is what Slurm does with the scripts: allocations, srun and torchrun launches, ranks across nodes, and
a failing rank ending the job.
"""

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import INJECT, REPO, processes_with

pytestmark = pytest.mark.slurm
SLOW = dict(PYTHONPATH=INJECT, FAULT_RANK="0", FAULT_SLEEP="0.3")  # steps slow enough to signal mid-epoch


def sbatch(cluster, script, tiny_data, output_dir, epochs=1, env=None):
    """Submit REPO/script from its folder with train.py arguments for the tiny data set and wait for
    the job: returns its id, `scontrol show job` fields and output. The output file is deleted, as job
    ids start again at 1 with every cluster and the scripts append to `<name>-<id>.out`."""
    job_id = cluster.submit(
        REPO / script, "--data-dir", tiny_data, "--epochs", epochs, "--output-dir", output_dir, env=env
    )
    log = Path(cluster.job_info(job_id)["StdOut"])
    try:
        info = cluster.wait(job_id)
        return job_id, info, log.read_text()
    finally:
        log.unlink(missing_ok=True)


def lines(output, prefix):
    return [line for line in output.splitlines() if line.startswith(prefix)]


def check_completed(info, output, output_dir, world_size):
    """A finished CPU run of one epoch: one banner, one epoch and one summary line, metrics.csv."""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    [banner] = lines(output, "torch ")
    assert "device cpu" in banner and f"world size {world_size}" in banner, banner
    assert len(lines(output, "epoch ")) == 1 and len(lines(output, "done:")) == 1, output  # rank 0 only
    rows = list(csv.DictReader(open(output_dir / "metrics.csv")))
    assert [int(row["world_size"]) for row in rows] == [world_size]


def check_two_nodes(info, output):
    """Four ranks, two per node, on node1 and node2: the rank map names Slurm's nodes. (torchrun's
    rendezvous may give ranks 0 and 1 to either node.)"""
    assert info["NodeList"] == "node[1-2]", info
    rank_map = [[field.strip() for field in line.split("|")[:3]] for line in lines(output, "  rank ")]
    assert [row[:2] for row in rank_map] == [[f"rank {r}", f"local rank {r % 2}"] for r in range(4)], output
    hosts = [row[2] for row in rank_map]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and {hosts[0], hosts[2]} == {"host node1", "host node2"}


@pytest.mark.parametrize("stage, world_size", [("01_single_gpu", 1), ("02_dataparallel", 1), ("03_ddp_single_node", 2)])
def test_single_node_job_script(slurm_cluster, tiny_data, tmp_path, stage, world_size):
    """01 (one GPU), 02 (DataParallel over the node's GPUs) and 03 (torchrun, one rank per GPU of
    $SLURM_GPUS_ON_NODE) complete under Slurm and write their metrics."""
    _, info, output = sbatch(slurm_cluster, f"{stage}/job.slurm", tiny_data, tmp_path / "out")
    check_completed(info, output, tmp_path / "out", world_size)


@pytest.mark.parametrize("script", ["job.slurm", "job_torchrun.slurm"])
def test_two_node_job_script(slurm_cluster, tiny_data, tmp_path, script):
    """04 runs one process group across two nodes, whether srun starts every rank (job.slurm) or one
    torchrun per node that meet in a c10d rendezvous on the first node (job_torchrun.slurm)."""
    _, info, output = sbatch(slurm_cluster, f"04_ddp_multi_node/{script}", tiny_data, tmp_path / "out")
    check_completed(info, output, tmp_path / "out", world_size=4)
    check_two_nodes(info, output)


def test_the_rendezvous_address_is_the_first_nodes_own(slurm_cluster, tmp_path):
    """Where each node has its own network: the MASTER_ADDR that srun tasks find (common.distributed) is
    the first node's name, and resolves, on both nodes, to the first node's own address, not to loopback."""
    if slurm_cluster.mode() != "netns":
        pytest.skip("the cluster runs in loopback mode: every node is 127.0.0.1")
    (tmp_path / "resolve.py").write_text(RESOLVE)
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --output=%x-%j.out\n"
        f"srun bash -c 'echo $(hostname) $({sys.executable} resolve.py) $(hostname -I)'\n"
    )
    info = slurm_cluster.wait(slurm_cluster.submit(script, env={"PYTHONPATH": str(REPO)}))
    output = Path(info["StdOut"]).read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    rows = {line.split()[0]: line.split()[1:] for line in output.splitlines() if line.startswith("node")}
    (addr1, ip1, *own1), (addr2, ip2, *_) = rows["node1"], rows["node2"]
    assert addr1 == addr2 == "node1" and ip1 == ip2 and ip1 in own1 and not ip1.startswith("127."), output


RESOLVE = """import socket
from common.distributed import launcher
addr = launcher().addr  # what every srun task meets at
print(addr, socket.gethostbyname(addr))
"""


def test_torchrun_rank_0_is_on_the_node_that_sorts_first_and_alone_needs_the_output_folder(slurm_cluster, tiny_data):
    """job_torchrun.slurm with --output-dir on node-local disk (the cluster's SCRATCH, each node's own).
    torch's c10d rendezvous numbers the agents by host name (then process id), so rank 0 runs on the
    node whose name sorts first: node1, as it happens also the first node and MASTER_ADDR. Rank 0 alone
    claims, writes and reads the output folder: the run completes, and node2 never makes one."""
    if slurm_cluster.mode() != "netns":
        pytest.skip("the cluster runs in loopback mode: no node-local folders")
    nodes = slurm_cluster.DIR / "nodes"
    try:
        _, info, output = sbatch(slurm_cluster, "04_ddp_multi_node/job_torchrun.slurm", tiny_data,
                                 slurm_cluster.SCRATCH / "out")  # fmt: skip
        check_completed(info, output, nodes / "node1/out", world_size=4)
        assert "  rank 0 | local rank 0 | host node1 " in output, output
        assert not (nodes / "node2/out").exists()
    finally:
        for node in ("node1", "node2"):
            shutil.rmtree(nodes / node / "out", ignore_errors=True)


def test_failing_rank_ends_the_job(slurm_cluster, tiny_data, tmp_path):
    """A rank that raises mid-training (rank 1 of 4, at its 3rd step, from tests/inject) fails the
    whole job seconds later, not after --dist-timeout (300 s), and leaves no process of the job behind."""
    inject = {"PYTHONPATH": f"{REPO / 'tests/inject'}{os.pathsep}{REPO}", "FAULT_RANK": "1", "FAULT_STEP": "3"}
    start = time.monotonic()
    job_id, info, output = sbatch(
        slurm_cluster, "04_ddp_multi_node/job.slurm", tiny_data, tmp_path / "out", epochs=2, env=inject
    )
    seconds = time.monotonic() - start
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", output
    assert "injected fault: rank 1 at step 3" in output, output
    assert seconds < 60, f"the job took {seconds:.0f} s to fail"
    deadline = time.monotonic() + 3
    while processes_with(f"SLURM_JOB_ID={job_id}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(f"SLURM_JOB_ID={job_id}") == []


def signal_mid_epoch_2(cluster, tiny_data, out, *how):
    """Submit stage 01 for 3 epochs with slow steps; once epoch 1 is in metrics.csv and two steps of epoch 2
    are done, `scancel *how`: returns the job's `scontrol show job` fields and log."""
    job_id = cluster.submit(REPO / "01_single_gpu/job.slurm", "--data-dir", tiny_data, "--epochs", 3,
                            "--batch-size", 32, "--output-dir", out, env=SLOW)  # fmt: skip
    log = Path(cluster.job_info(job_id)["StdOut"])
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.csv").exists() and "\n1," in (out / "metrics.csv").read_text()):
            assert time.monotonic() < deadline, "no epoch 1"
            time.sleep(0.1)
        time.sleep(0.7)
        subprocess.run(["scancel", *how, job_id], check=True)
        return cluster.wait(job_id, timeout=240), log.read_text()
    finally:
        log.unlink(missing_ok=True)


def test_preempted_job_requeues_and_resumes_at_the_same_sample(slurm_cluster, tiny_data, tmp_path):
    """USR1 to the batch script, as Slurm sends it before a time limit (--signal=B:USR1@90): the step saves
    mid-epoch, the job requeues itself, comes back with the same id and output folder, resumes at the step
    where it stopped and completes with the weights of a job that was never stopped."""
    # never stopped: without SLOW's sleeps
    job_id = slurm_cluster.submit(REPO / "01_single_gpu/job.slurm", "--data-dir", tiny_data, "--epochs", 3,
                                  "--batch-size", 32, "--output-dir", tmp_path / "whole")  # fmt: skip
    log = Path(slurm_cluster.job_info(job_id)["StdOut"])
    assert slurm_cluster.wait(job_id, timeout=240)["JobState"] == "COMPLETED", log.read_text()
    log.unlink()
    out = tmp_path / "out"
    info, output = signal_mid_epoch_2(slurm_cluster, tiny_data, out, "--signal=USR1", "--batch")
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), output
    assert "USR1: stopping the step, then requeueing job" in output
    [saved] = lines(output, "saved at epoch 2, step ")
    step = int(saved.split("step ")[1].split(":")[0])
    [resumed] = lines(output, "resumed at epoch 2, step ")
    assert resumed.startswith(f"resumed at epoch 2, step {step} (Slurm restart 1,"), resumed
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]  # every epoch once, epoch 2 in one row
    ours, theirs = (torch.load(f / "checkpoint.pt", weights_only=True)["model"] for f in (out, tmp_path / "whole"))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_scancel_saves_within_killwait(slurm_cluster, tiny_data, tmp_path):
    """scancel: SIGTERM to the step, SIGKILL KillWait later; the ranks save mid-epoch before it."""
    info, output = signal_mid_epoch_2(slurm_cluster, tiny_data, tmp_path / "out")
    assert info["JobState"] == "CANCELLED", output
    [saved] = lines(output, "saved at epoch 2, step ")
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 2 and f"step {state['step']}:" in saved


HIDE_INSTALL = (  # a sitecustomize that removes what `make install` added: an editable finder and path hook
    "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
    "sys.path[:] = [p for p in sys.path if 'editable' not in p]\n"
)


@pytest.mark.parametrize(
    "script, world_size",
    [("01_single_gpu/job.slurm", 1), ("03_ddp_single_node/job.slurm", 2), ("04_ddp_multi_node/job_torchrun.slurm", 4)],
)
def test_a_stage_copied_beside_common_runs_in_any_environment(slurm_cluster, tiny_data, tmp_path, script, world_size):
    """The newcomer's path: the stage folder and common/ copied into a project of one's own, an active
    environment with torch that has nothing of this repository installed, `sbatch job.slurm` unedited."""
    project = tmp_path / "project"
    stage = project / Path(script).parent.name
    shutil.copytree(REPO / Path(script).parent, stage)
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE_INSTALL)
    env = {"PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "hide")}
    args = ["--data-dir", tiny_data, "--epochs", 1, "--output-dir", tmp_path / "out"]
    job_id = slurm_cluster.submit(stage / Path(script).name, *args, env=env, cwd=stage)
    info = slurm_cluster.wait(job_id)
    output = Path(info["StdOut"]).read_text()
    check_completed(info, output, tmp_path / "out", world_size)
