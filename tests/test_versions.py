"""The oldest torch each stage and the doctor run on (common/guards/versions.py): below it, one line naming both
versions and the fix, before torch is imported. `make test-min` runs this file on each of those versions:
there each script runs on its own minimum, and meets a torch really older than it needs."""

import re
import sys

import pytest
from helpers import HANG, REPO, STAGES, clean_env, run, srun_like, stage_args, torchrun
from test_failures import one_error

from common.guards import versions

FOUND = versions.installed()
SCRIPTS = [f"{stage}/train.py" for stage in STAGES] + ["tools/doctor.py"]


def fake_torch(folder, version):
    """A torch-<version>.dist-info ahead on the path: what the check reads (the torch imported is still this one)."""
    info = folder / f"torch-{version}.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return clean_env(PYTHONPATH=f"{folder}:{REPO}")


def imported(stderr):
    """The modules `python -X importtime` lists as imported."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_a_torch_older_than_the_stage_needs_is_one_line_before_torch_is_imported(tmp_path):
    env = fake_torch(tmp_path, "2.6.0")
    out = run([sys.executable, "-X", "importtime", "05_fsdp/train.py"], env=env, timeout=HANG)
    one_error(out, "05_fsdp/train.py needs torch ≥ 2.9 (this is 2.6.0)", "`module load`", "pip install 'torch>=2.9'")
    assert out.returncode == 1 and "torch" not in imported(out.stderr)  # in its first second, not after torch's
    assert run([sys.executable, "01_single_gpu/train.py", "--help"], env=env).returncode == 0  # 2.6 runs stage 01


def test_the_job_scripts_check_and_the_doctor_refuse_an_older_torch(tmp_path):
    env = fake_torch(tmp_path, "2.6.0")
    out = run([sys.executable, "-m", "common.guards.check", "--epochs", "1"], env=env, cwd=REPO / "03_ddp_single_node")
    one_error(out, "03_ddp_single_node/train.py needs torch ≥ 2.7 (this is 2.6.0)")  # the stage the job runs
    assert out.returncode == 1
    out = run([sys.executable, "tools/doctor.py"], env=env, timeout=HANG)
    one_error(out, "tools/doctor.py needs torch ≥ 2.7 (this is 2.6.0)")
    assert out.returncode == 1


@pytest.mark.parametrize("script", SCRIPTS)
def test_on_the_oldest_torch_it_needs(script, tiny_data, tmp_path):
    """make test-min: on the oldest torch it runs on, a script runs (one epoch; two ranks where it has several);
    below it, it refuses in one line. Newer torches: skipped here, every other test runs it."""
    minimum = versions.needs(REPO / script)
    need, found = versions.release(minimum), versions.release(FOUND)
    args = stage_args(tiny_data, tmp_path) + (["--epochs", "1"] if script.endswith("train.py") else [])
    if found < need:
        out = run([sys.executable, script, *args], timeout=HANG)
        one_error(out, f"{script} needs torch ≥ {minimum} (this is {FOUND})")
        assert out.returncode == 1
        return
    if found[: len(need)] != need:
        pytest.skip(f"torch {FOUND} is newer than {script} needs: make test-min runs it on its oldest")
    if script.startswith("04"):  # srun's tasks, the launcher stage 04 teaches
        codes, outputs = srun_like(2, REPO / script, *args)
        assert codes == [0, 0], outputs
        out = outputs[0]
    else:
        one = script.startswith(("01", "02"))
        result = run([sys.executable, script, *args]) if one else torchrun(2, REPO / script, *args)
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
    assert "done: 1 epochs" in out or "doctor: 2 ranks on 1 node" in out, out


def test_requirements_and_make_test_min_name_the_minimums():
    requirements = (REPO / "requirements.txt").read_text()
    assert f"torch>={max(versions.TORCH.values(), key=versions.release)}" in requirements  # every stage runs on it
    pins = re.search(r"^MIN_TORCH := (.*)$", (REPO / "Makefile").read_text(), re.M)[1].split()
    assert sorted(pins) == sorted(f"{v}.0" for v in set(versions.TORCH.values()))  # each minimum's first release
