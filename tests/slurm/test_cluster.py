# SPDX-License-Identifier: BSD-3-Clause
"""Self-test of the local Slurm cluster: multi-node srun, fake GPUs, and a failing job."""

import subprocess
from pathlib import Path

import pytest

from common.environment import first_host

pytestmark = pytest.mark.slurm

FIELDS = "$SLURM_PROCID $SLURM_LOCALID $SLURMD_NODENAME ${CUDA_VISIBLE_DEVICES-unset} ${SLURM_STEP_ID-unset}"


def write_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --output=%x-%j.out\n" + body)
    return script


def test_two_nodes_two_tasks_each_with_two_gpus(slurm_cluster, tmp_path):
    script = write_script(
        tmp_path,
        "#SBATCH --nodes=2 --ntasks-per-node=2 --gres=gpu:2\n"
        f'echo "batch {FIELDS}"\n'  # the batch step itself: it is not one of the ranks
        f"srun bash -c 'echo \"task {FIELDS}\"'\n",
    )
    info = slurm_cluster.wait(slurm_cluster.submit(script))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    lines = Path(info["StdOut"]).read_text().split("\n")
    batch = [line.split()[1:] for line in lines if line.startswith("batch ")]
    tasks = sorted(line.split()[1:] for line in lines if line.startswith("task "))
    assert batch == [["0", "0", "node1", "0,1", "unset"]]  # SLURM_STEP_ID is unset outside srun
    assert [t[:2] for t in tasks] == [["0", "0"], ["1", "1"], ["2", "0"], ["3", "1"]]
    assert {t[2] for t in tasks} == {"node1", "node2"}
    assert all(t[3:] == ["0,1", "0"] for t in tasks), tasks


def test_failing_job_reports_its_exit_code(slurm_cluster, tmp_path):
    info = slurm_cluster.wait(slurm_cluster.submit(write_script(tmp_path, "exit 3\n")))
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0"), info


@pytest.mark.parametrize("hostlist", ["node[01-03,07]", "r[1-2]n[1-2],login", "gpu-a[9-11]-[0-1],cpu[1,3]"])
def test_the_first_host_is_the_one_scontrol_lists_first(slurm_cluster, hostlist):
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, check=True)
    assert first_host(hostlist) == out.stdout.split()[0]
