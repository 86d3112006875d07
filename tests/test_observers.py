"""The guard rails observe the lesson: every `guard.` line of a stage can be deleted and the training is the same.
Each stage trains with a guard that does nothing (tests/no_guard.py) and with the real one: bit-identical weights."""

import pytest
import torch
from helpers import REPO, STAGES, checkpoint, python, stage_args, torchrun

NO_GUARD = REPO / "tests" / "no_guard.py"


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_trains_the_same_without_its_guard_rails(tiny_data, tmp_path, stage):
    script, args = REPO / stage / "train.py", ["--epochs", 1, "--save-model", "--batch-size", 32]
    ranks = 2 if stage >= "03" else None  # the stages that launch several ranks, at two of them
    for name, how in (("guarded", [script]), ("bare", [NO_GUARD, script])):
        every = stage_args(tiny_data, tmp_path / name, *args)
        out = torchrun(ranks, *how, *every) if ranks else python(*how, *every)
        assert out.returncode == 0, out.stderr[-2000:]
    guarded, bare = checkpoint(tmp_path / "guarded", "model.pt"), checkpoint(tmp_path / "bare", "model.pt")
    assert guarded.keys() == bare.keys()
    for name in guarded:
        torch.testing.assert_close(guarded[name], bare[name], rtol=0, atol=0, msg=name)
