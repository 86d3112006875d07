"""One reading of the launcher, and one line for any failure: the invariants of common/environment.py's
launcher() and common/guards/rails.py's run(). What each test proves is in tests/FAILURES.md."""

import pytest

from common.environment import is_rank0, launcher
from common.guards import check
from tests.helpers import S01, S03, free_port, metrics, python, stage_args

TORCHRUN = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2"}  # fmt: skip


@pytest.mark.parametrize(
    "env, rank",
    [({**TORCHRUN, "RANK": "00"}, 0), ({**TORCHRUN, "RANK": " 0"}, 0), ({**TORCHRUN, "RANK": " 1"}, 1),
     ({**SRUN, "SLURM_PROCID": "00"}, 0), ({**SRUN, "SLURM_NTASKS": "1"}, 0),  # an srun step without SLURM_PROCID
     ({**SRUN, "SLURM_PROCID": "1", **TORCHRUN, "RANK": "0"}, 0),  # srun torchrun: torchrun's rank wins
     ({**SRUN, "SLURM_PROCID": "0", **TORCHRUN, "RANK": "1"}, 1)],
)  # fmt: skip
def test_one_reading_of_the_launcher(env, rank):
    """The rank the guard rails accept is the rank the process group joins as and the one is_rank0() reads:
    before, RANK=00 joined as rank 0 while is_rank0() said no, and the run printed and wrote nothing."""
    check.check_environment(env)
    assert launcher(env).rank == rank
    assert is_rank0(env) == (rank == 0)


@pytest.mark.parametrize("value", ["²", "1.0", "-1", "0x1", "1_0"])
def test_a_rank_the_launcher_cannot_read_is_refused_not_guessed(value):
    """What the check refuses, launcher() reads as no rank (and no rank 0), never as a number of its own."""
    env = {**TORCHRUN, "RANK": value}
    with pytest.raises(SystemExit, match="RANK="):
        check.check_environment(env)
    assert launcher(env).rank is None and not is_rank0(env)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, env",
    [(S03, {"RANK": "00", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}),
     (S01, {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"})],  # an srun step without SLURM_PROCID
)  # fmt: skip
def test_rank_0_of_a_launch_prints_and_writes(script, env, tiny_data, tmp_path):
    """Before, these trained, printed nothing, wrote nothing and ended with status 0."""
    env = env | ({"MASTER_PORT": free_port()} if "RANK" in env else {})
    out = python(script, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--limit", 64), **env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch 1" in out.stdout.lower() and len(metrics(tmp_path)) == 1, out.stdout[-2000:]
    assert (tmp_path / "checkpoint.pt").is_file()
