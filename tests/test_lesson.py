"""A default run runs its lesson: the statements inside the lesson definitions a stage reaches (tools/reading_path.py,
what a learner reads from train.py into common/) are, four in five at least, statements a default run executes. A
statement that no default run executes belongs to an option (common/options/) or a guard rail (common/guards/)."""

import ast
import json

import pytest
from helpers import REPO, S01, S03, python, stage_args, torchrun
from test_budgets import reached

TRACER = REPO / "tests" / "trace_lesson.py"
EXECUTED = 0.8  # of the reached lesson's statements


def statements(key):
    """(file, line) of each statement inside the definition `key` ("module:name"): not its docstring, nor a nested
    definition's own line."""
    module, name = key.split(":")
    path = REPO / (module.replace(".", "/") + ".py")
    node = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", None) == name)
    docstrings = {
        id(n.body[0])
        for n in ast.walk(node)
        if isinstance(n, ast.FunctionDef | ast.ClassDef) and ast.get_docstring(n) is not None
    }
    skipped = (ast.FunctionDef, ast.ClassDef)
    return {
        (str(path), n.lineno)
        for n in ast.walk(node)
        if isinstance(n, ast.stmt) and n is not node and not isinstance(n, skipped) and id(n) not in docstrings
    }


@pytest.mark.parametrize("stage", [S01, pytest.param(S03, marks=pytest.mark.slow)], ids=["01", "03 at 2 ranks"])
def test_a_default_run_executes_the_lesson_it_reaches(stage, tiny_data, tmp_path):
    args = stage_args(tiny_data, tmp_path / "out", "--epochs", 1)
    out = python(TRACER, tmp_path, stage, *args) if stage == S01 else torchrun(2, TRACER, tmp_path, stage, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = sorted(tmp_path.glob("rank*.json"))
    assert len(ranks) == (1 if stage == S01 else 2), ranks
    ran = {tuple(line) for rank in ranks for line in json.loads(rank.read_text())}
    lesson = {line for key in reached(stage.parent.name) for line in statements(key)}
    missed = sorted(lesson - ran)
    assert len(lesson) > 200 and len(lesson & ran) >= EXECUTED * len(lesson), missed
