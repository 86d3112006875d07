"""The guard rails observe the lesson: every `guard.` line of a stage can be deleted and the training is the same.
Each stage trains with a guard that does nothing (tests/no_guard.py) and with the real one: bit-identical weights.
The guarded runs are the shared reference runs of conftest.py's `uninterrupted` where one has these options."""

import ast

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


def guard_calls(tree):
    """Each call of a guard's method (`guard.x(...)`) in `tree`, with the node that holds it."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        receiver = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if isinstance(receiver, ast.Name) and receiver.id == "guard":
            yield node, parents[node]


@pytest.mark.parametrize("stage", RUNS)
def test_no_value_of_a_guard_call_is_used_and_no_guard_is_lesson_data(stage):
    """Every `guard.x(...)` of a stage stands as a statement of its own: nothing the lesson uses comes from it,
    and the guard is in none of the lesson's data (the states a checkpoint saves, any dict, list or tuple)."""
    tree = ast.parse((REPO / stage / "train.py").read_text())
    used = [ast.unparse(parent) for _, parent in guard_calls(tree) if not isinstance(parent, ast.Expr)]
    assert used == [], f"{stage}: the values of guard calls are used: {used}"
    held = [ast.unparse(node) for node in ast.walk(tree) if holds_guard(node)]
    assert held == [], f"{stage}: the guard is lesson data: {held}"


def holds_guard(node):
    """Is `node` a dict, list, tuple or set (a display, or a call of dict() and the like) with the guard in it?"""
    if isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
        values = node.values if isinstance(node, ast.Dict) else node.elts
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("dict", "list", "tuple", "set"):
        values = node.args + [k.value for k in node.keywords]
    else:
        return False
    return any(isinstance(v, ast.Name) and v.id == "guard" for v in values)
