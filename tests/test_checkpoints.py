"""Checkpoints a run can trust: the last two complete ones kept, a damaged one named by file with the one
before it to resume from, and no fresh run over a folder that holds any stage's checkpoint."""

import sys

import pytest
import torch
from helpers import REPO, clean_env, one_error, run, stage_args

from common import resumable, rundir

S01, S05 = REPO / "01_single_gpu" / "train.py", REPO / "05_fsdp" / "train.py"


def python(script, data_dir, out, *extra):
    return run([sys.executable, str(script), *stage_args(data_dir, out, "--limit", 64, *extra)], env=clean_env())


def test_a_damaged_checkpoint_names_itself_and_the_previous_one_resumes(tiny_data, tmp_path):
    assert python(S01, tiny_data, tmp_path, "--epochs", 2).returncode == 0
    previous = tmp_path / resumable.PREVIOUS
    assert torch.load(previous, weights_only=True)["epoch"] == 1  # the epoch before checkpoint.pt's
    latest = tmp_path / "checkpoint.pt"
    latest.write_bytes(latest.read_bytes()[:1000])  # truncated by a failing disk, or by hand
    out = python(S01, tiny_data, tmp_path, "--epochs", 3, "--resume")
    one_error(
        out,
        f"{latest} is not a checkpoint this code wrote, or is damaged",
        "epoch 1 is complete",
        f"--resume {previous}",
    )
    out = python(S01, tiny_data, tmp_path, "--epochs", 3, "--resume", previous)
    assert out.returncode == 0, out.stderr
    assert "resumed after epoch 1" in out.stdout and torch.load(latest, weights_only=True)["epoch"] == 3


@pytest.mark.slow  # the whole-checkpoint case above runs in make test
def test_a_damaged_shard_or_missing_metadata_is_named_by_file(tiny_data, tmp_path):
    """Stage 05 keeps its last two sharded checkpoints (one process: the shards of one rank)."""
    assert python(S05, tiny_data, tmp_path, "--epochs", 2).returncode == 0
    assert [f.name for f in resumable.epochs(tmp_path)] == ["epoch-2", "epoch-1"]
    shard = next((tmp_path / "epoch-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    out = python(S05, tiny_data, tmp_path, "--epochs", 3, "--resume")
    one_error(out, f"{shard} is truncated", f"--resume {tmp_path / 'epoch-1'}")
    (tmp_path / "epoch-2" / ".metadata").unlink()
    one_error(
        python(S05, tiny_data, tmp_path, "--epochs", 3, "--resume"), f"{tmp_path / 'epoch-2' / '.metadata'} is missing"
    )
    out = python(S05, tiny_data, tmp_path, "--epochs", 3, "--resume", tmp_path / "epoch-1")
    assert out.returncode == 0, out.stderr
    assert [f.name for f in resumable.epochs(tmp_path)] == ["epoch-3", "epoch-2"]


def test_a_fresh_run_refuses_a_folder_with_any_stages_checkpoint(tiny_data, tmp_path):
    """Without --resume, neither stage 01 over stage 05's sharded checkpoint nor 05 over 01's whole one."""
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert python(S01, tiny_data, whole, "--epochs", 1).returncode == 0
    assert python(S05, tiny_data, sharded, "--epochs", 1).returncode == 0
    for script, folder, found in ((S05, whole, "checkpoint.pt"), (S01, sharded, "checkpoint")):
        metrics = (folder / "metrics.csv").read_text()
        one_error(
            python(script, tiny_data, folder, "--epochs", 1), f"{folder / found} holds the checkpoint", "--resume"
        )
        assert (folder / "metrics.csv").read_text() == metrics
    kind = "it holds checkpoint, of stage 05"  # --resume in the other kind's folder says which it holds
    one_error(python(S01, tiny_data, sharded, "--epochs", 2, "--resume"), f"no checkpoint.pt in {sharded}", kind)


def test_the_previous_checkpoint_is_kept_where_hard_links_fail(tmp_path, monkeypatch):
    """Some FUSE filesystems refuse hard links: the previous checkpoint is then a copy, switched in alike."""
    latest, previous = tmp_path / "checkpoint.pt", tmp_path / resumable.PREVIOUS
    for epoch in (1, 2):
        with rundir.atomic(latest, keep=previous) as f:
            torch.save({"epoch": epoch}, f)
        monkeypatch.setattr(rundir.os, "link", lambda *a: (_ for _ in ()).throw(PermissionError(1, "no links")))
    assert torch.load(previous)["epoch"] == 1 and torch.load(latest)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-previous.pt", "checkpoint.pt"]
