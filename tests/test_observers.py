"""The guard rails observe the lesson: every `guard.` line of a stage can be deleted and the training is the same.
Each stage trains with a guard that does nothing (tests/no_guard.py) and with the real one: bit-identical weights."""

import ast

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


def guard_calls(tree):
    """The calls of a guard's method (`guard.x(...)`) in `tree`, with the node that holds each."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        receiver = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
        if isinstance(receiver, ast.Name) and receiver.id == "guard":
            yield node, parents[node]


@pytest.mark.parametrize("stage", STAGES)
def test_no_value_of_a_guard_call_is_used_and_no_guard_is_lesson_data(stage):
    """Every `guard.x(...)` stands as a statement of its own: nothing the lesson uses comes from it, and the
    guard is in none of the lesson's data (the states a checkpoint saves, a dict, a list)."""
    tree = ast.parse((REPO / stage / "train.py").read_text())
    used = [ast.unparse(parent) for call, parent in guard_calls(tree) if not isinstance(parent, ast.Expr)]
    assert used == [], f"{stage}: values of guard calls used: {used}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("dict", "list", "tuple", "set"):
            held = [k.arg for k in node.keywords if isinstance(k.value, ast.Name) and k.value.id == "guard"]
            assert held == [], f"{stage}: the guard is lesson data: {ast.unparse(node)}"
