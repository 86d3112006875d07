"""The oldest torch each stage and the doctor run on (common/versions.py): below it, one line naming both
versions and the fix, before torch is imported."""

import sys

from helpers import REPO, clean_env, run
from test_failures import one_error


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
    out = run([sys.executable, "-X", "importtime", "05_fsdp/train.py"], env=env, timeout=30)
    one_error(out, "05_fsdp/train.py needs torch ≥ 2.9 (this is 2.6.0)", "`module load`", "pip install 'torch>=2.9'")
    assert out.returncode == 1 and "torch" not in imported(out.stderr)  # in its first second, not after torch's
    assert run([sys.executable, "01_single_gpu/train.py", "--help"], env=env).returncode == 0  # 2.6 runs stage 01


def test_the_job_scripts_check_and_the_doctor_refuse_an_older_torch(tmp_path):
    env = fake_torch(tmp_path, "2.6.0")
    out = run([sys.executable, "-m", "common.cli", "--epochs", "1"], env=env, cwd=REPO / "03_ddp_single_node")
    one_error(out, "03_ddp_single_node/train.py needs torch ≥ 2.7 (this is 2.6.0)")  # the stage the job runs
    assert out.returncode == 1
    out = run([sys.executable, "tools/doctor.py"], env=env, timeout=60)
    one_error(out, "tools/doctor.py needs torch ≥ 2.7 (this is 2.6.0)")
    assert out.returncode == 1
