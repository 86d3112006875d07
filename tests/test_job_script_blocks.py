"""What the job scripts share stays the same text everywhere, so that it never shows in the diffs
between stages (their lengths: test_budgets.py)."""

import re
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

SCRIPTS = sorted(REPO.glob("0*/*.slurm"))
SWEEP = REPO / "sweeps/batch_size.slurm"


def block(path, first="# GPU use every 5 s", last="fi"):
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    return lines[start : lines.index(last, start) + 1]


def test_gpu_log_block_is_the_same_in_every_job_script():
    blocks = {path.relative_to(REPO).as_posix(): block(path) for path in SCRIPTS}
    first = blocks["01_single_gpu/job.slurm"]
    assert len(blocks) == 6 and all(b == first for b in blocks.values()), blocks
    # the sweep names its GPU log as its log, after the array: %x-%A_%a
    sweep = [line.replace("${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID", "$SLURM_JOB_ID") for line in block(SWEEP)]
    assert sweep == first


def test_strict_mode_and_the_python_environment_are_the_same_everywhere():
    """Strict mode before the environment lines, so that a failure there stops the job where it happens."""
    blocks = [block(path, first="set -euo pipefail", last="fi") for path in [*SCRIPTS, SWEEP]]
    assert len(blocks) == 7 and all(b == blocks[0] for b in blocks) and "source" in blocks[0][5]


def test_without_python_and_torch_a_copied_job_script_names_the_line_to_edit(tmp_path):
    """Copied elsewhere, with no environment active and no .venv beside it: one line, at once."""
    copy = tmp_path / "elsewhere" / "01_single_gpu"
    copy.mkdir(parents=True)
    script = copy / "job.slurm"
    script.write_text((REPO / "01_single_gpu/job.slurm").read_text())
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # a python without torch
    (tmp_path / "bin" / "python").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(copy)}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    line = int(re.search(r"at line (\d+) of the job script", out.stderr)[1])
    assert out.returncode == 1 and out.stderr.count("error:") == 1 and not out.stdout, out
    assert "set yours up here" in script.read_text().splitlines()[line - 1]


def test_the_torchrun_job_script_derives_the_port_as_setup_does():
    """job_torchrun.slurm repeats common/environment.py's port formula in shell (it says so): the same ports."""
    from common.environment import master_port

    line = next(
        x
        for x in (REPO / "04_ddp_multi_node/job_torchrun.slurm").read_text().splitlines()
        if x.startswith("MASTER_PORT=")
    )
    for job_id in (1, 39_999, 40_000, 123_456_789):
        shell = subprocess.run(
            ["bash", "-c", f"SLURM_JOB_ID={job_id}; {line}; echo $MASTER_PORT"], capture_output=True, text=True
        )
        assert int(shell.stdout) == master_port(job_id)


@pytest.mark.slow
def test_a_job_whose_tasks_per_node_differ_from_its_gpus_stops_in_one_line():
    """The scripts that start a rank per task check the one rule a user must keep by hand."""
    import sys

    for script in ("04_ddp_multi_node/job.slurm", "05_fsdp/job.slurm"):
        folder = (REPO / script).parent
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(folder),
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
        out = subprocess.run(
            ["bash", str(REPO / script)], env=env, cwd=folder, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 1 and out.stderr == "error: --ntasks-per-node=2 but --gres=gpu:4: make them equal\n", (
            out
        )
