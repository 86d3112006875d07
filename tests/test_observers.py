"""The guard rails observe the lesson: every `guard.` line of a stage can be deleted and the training is the same.
Each stage trains with a guard that does nothing (tests/no_guard.py) and with the real one: bit-identical weights.
The guarded runs are the shared reference runs of conftest.py's `uninterrupted` where one has these options."""

import pytest
import torch
from helpers import REPO, checkpoint, python, stage_args, torchrun

NO_GUARD = REPO / "tests" / "no_guard.py"
RUNS = {  # stage: (launch, options), as other tests train them
    "01_single_gpu": ("python", ["--epochs", 2, "--batch-size", 32]),  # test_preemption.py's
    "02_dataparallel": ("python", ["--epochs", 1]),
    "03_ddp_single_node": (2, ["--epochs", 1, "--save-model"]),  # test_fsdp.py's and test_checkpoints.py's
    "04_ddp_multi_node": (2, ["--epochs", 1]),
    "05_fsdp": (2, ["--epochs", 1, "--save-model"]),  # test_fsdp.py's
}


def weights(folder):
    """The trained weights: model.pt (stage 05's shards gathered), else the checkpoint's model."""
    return checkpoint(folder, "model.pt") if (folder / "model.pt").exists() else checkpoint(folder)["model"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", RUNS)
def test_every_stage_trains_the_same_without_its_guard_rails(uninterrupted, tiny_data, tmp_path, stage):
    launch, options = RUNS[stage]
    script = REPO / stage / "train.py"
    guarded = uninterrupted(launch, script, *options)
    args = stage_args(tiny_data, tmp_path, *options)
    bare = python(NO_GUARD, script, *args) if launch == "python" else torchrun(launch, NO_GUARD, script, *args)
    assert bare.returncode == 0, bare.stderr[-2000:]
    ours, theirs = weights(tmp_path), weights(guarded)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
