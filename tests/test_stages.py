"""Every stage end to end, as the real script in real processes, on a tiny real-format MNIST."""

import shutil
import sys

import pytest
import torch
from helpers import (
    HANG,
    REPO,
    S01,
    S03,
    S04,
    STAGES,
    TEST_SIZE,
    TRAIN_SIZE,
    checkpoint,
    clean_env,
    metrics,
    run,
    srun_like,
    stage_args,
    torchrun,
)

from common import data
from common.metrics import FIELDS
from common.models import Net


def check_run(output, output_dir, world_size, epochs=2):
    """What every stage must print and write, whatever the launcher."""
    assert output.count("torch ") == 1, output  # one banner, from rank 0 only
    assert f"world size {world_size}" in output
    assert output.count("\noptions: --data-dir ") == 1 and output.count(f"| output {output_dir}\n") == 1  # what ran
    assert sum(line.startswith("  rank ") for line in output.splitlines()) == world_size  # the rank map
    epoch_lines = [line for line in output.splitlines() if line.startswith("epoch ")]
    assert len(epoch_lines) == epochs, output  # one line per epoch, from rank 0 only
    assert f"/{TEST_SIZE} (" in epoch_lines[-1]  # every test image counted once
    assert output.count("done: ") == 1
    rows = metrics(output_dir)
    assert list(rows[0]) == FIELDS and len(rows) == epochs
    assert [int(r["world_size"]) for r in rows] == [world_size] * epochs
    assert float(rows[1]["lr"]) == pytest.approx(0.7 * float(rows[0]["lr"]))
    for r in rows:
        assert float(r["images_per_s"]) == pytest.approx(float(r["images_per_s_per_process"]) * world_size)
        assert 0 <= float(r["test_accuracy"]) <= 100 and float(r["train_loss"]) > 0
    return rows


@pytest.mark.slow
def test_stage01_twice_with_one_seed_ends_bit_identical(tiny_data, tmp_path):
    """Stage 01 end to end, twice: the same seed gives bit-identical weights on the CPU, so a regression cannot
    hide behind noise."""
    weights = []
    for folder in (tmp_path / "a", tmp_path / "b"):
        args = stage_args(tiny_data, folder, "--epochs", 2, "--save-model")
        out = run([sys.executable, "01_single_gpu/train.py", *args])
        assert out.returncode == 0, out.stderr
        check_run(out.stdout, folder, world_size=1)
        weights.append(checkpoint(folder, "model.pt"))
    Net().load_state_dict(weights[0])  # plain keys, any stage loads it
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


@pytest.mark.parametrize("stage", [STAGES[1], pytest.param(STAGES[2], marks=pytest.mark.slow)])
def test_single_process_stages(stage, tiny_data, tmp_path):
    """Stage 02, and stage 03 without a launcher: one process, world size 1. On a CPU, stage 02 cannot reach
    nn.DataParallel, which it uses only with two GPUs or more: here it runs as stage 01 does, and no CPU test
    covers what it adds."""
    out = run([sys.executable, f"{stage}/train.py", *stage_args(tiny_data, tmp_path, "--epochs", 2, "--save-model")])
    assert out.returncode == 0, out.stderr
    check_run(out.stdout, tmp_path, world_size=1)
    Net().load_state_dict(checkpoint(tmp_path, "model.pt"))  # plain keys, any stage loads it


@pytest.mark.slow  # make test: test_data.py checks each pipeline's batches, test_one_line.py runs classic's workers
@pytest.mark.parametrize(
    "flags", [("--loader", "classic", "--limit", "100"), ("--loader", "device", "--amp")], ids=" ".join
)
def test_stage01_with_other_pipelines(flags, tiny_data, tmp_path):
    out = run([sys.executable, "01_single_gpu/train.py", *stage_args(tiny_data, tmp_path, "--epochs", 2, *flags)])
    assert out.returncode == 0, out.stderr
    rows = check_run(out.stdout, tmp_path, world_size=1)
    if "--limit" in flags:  # 100 training images: two batches of 64 and 36
        assert "batch 0/2 " in out.stdout
        assert float(rows[0]["images_per_s"]) * float(rows[0]["epoch_seconds"]) == pytest.approx(100)


def test_stage03_under_torchrun(tiny_data, tmp_path):
    out = torchrun(2, S03, *stage_args(tiny_data, tmp_path, "--epochs", 2))
    assert out.returncode == 0, out.stderr
    rows = check_run(out.stdout, tmp_path, world_size=2)
    assert sum(float(r["images_per_s"]) * float(r["epoch_seconds"]) for r in rows) == pytest.approx(2 * TRAIN_SIZE)


def test_stage04_as_srun_tasks(tiny_data, tmp_path):
    codes, outputs = srun_like(2, S04, *stage_args(tiny_data, tmp_path, "--epochs", 2))
    assert codes == [0, 0], outputs
    check_run(outputs[0], tmp_path, world_size=2)
    assert "epoch " not in outputs[1] and "torch " not in outputs[1]  # rank 1 prints nothing


@pytest.mark.slow
def test_copied_stage_runs_from_its_own_folder(tiny_data, tmp_path):
    """A stage folder copied elsewhere imports the installed common/; with nothing installed, the common/
    copied beside it; with neither, it says what to copy."""
    project = tmp_path / "mine"
    copy = project / "01_single_gpu"
    copy.mkdir(parents=True)
    copy.joinpath("train.py").write_text((S01).read_text())
    out = run([sys.executable, "train.py", *stage_args(tiny_data, tmp_path / "out", "--epochs", "1")], cwd=copy)
    assert out.returncode == 0, out.stderr
    # nothing installed: a sitecustomize removes what `make install` added (an editable finder and path hook)
    hide = tmp_path / "hide"
    hide.mkdir()
    hide.joinpath("sitecustomize.py").write_text(
        "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "sys.path[:] = [p for p in sys.path if 'editable' not in p]\n"
    )
    out = run([sys.executable, "train.py"], env=clean_env(PYTHONPATH=str(hide)), cwd=copy)
    assert out.returncode != 0 and f"no common/ beside {copy}" in out.stderr, out.stderr
    shutil.copytree(REPO / "common", project / "common")
    args = stage_args(tiny_data, tmp_path / "out2", "--epochs", "1")
    out = run([sys.executable, copy / "train.py", *args], env=clean_env(PYTHONPATH=str(hide)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_batch_step_trap_fails_fast(tiny_data, tmp_path):
    """The batch shell of a 4-task job is not a rank: it must say so instead of waiting for peers."""
    env = clean_env(SLURM_NTASKS=4, SLURM_PROCID=0, SLURM_JOB_ID=7, SLURM_JOB_NODELIST="node[1-2]")
    out = run([sys.executable, "04_ddp_multi_node/train.py", *stage_args(tiny_data, tmp_path)], env=env, timeout=HANG)
    assert out.returncode != 0 and "srun" in out.stderr and "SLURM_NTASKS=4" in out.stderr, out.stderr


def test_missing_data_names_path_and_the_command_that_prepares_it(tmp_path):
    out = run([sys.executable, "01_single_gpu/train.py", *stage_args(tmp_path / "empty", tmp_path)], timeout=HANG)
    assert out.returncode != 0 and str(tmp_path / "empty" / "MNIST" / "raw") in out.stderr
    assert f"run `python tools/prepare_data.py {tmp_path / 'empty'} mnist`" in out.stderr  # `make data`: data/ alone


def test_tiny_data_reads_as_real_mnist(tiny_data):
    train = data.dataset(tiny_data, "mnist", train=True)
    x, y = train[[0, 1, 2]]
    assert len(train) == TRAIN_SIZE and x.shape == (3, 1, 28, 28) and y.tolist() == [5, 0, 4]  # MNIST's first labels


@pytest.mark.slow
def test_make_profile_times_each_line_of_train(tiny_data, tmp_path):
    """kernprof -l, as `make profile` runs it, times train()'s lines through the stages' @metrics.profile."""
    stats = tmp_path / "run.lprof"
    args = stage_args(tiny_data, tmp_path / "out", "--epochs", "1")
    out = run([sys.executable, "-m", "kernprof", "-l", "-o", stats, S01, *args])
    assert out.returncode == 0, out.stderr
    shown = run([sys.executable, "-m", "line_profiler", stats]).stdout
    assert "Function: train at line" in shown and "loss = step.run(step, x, y)" in shown, shown
