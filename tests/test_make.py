"""The Makefile: `make help` lists every target, `make diff` shows the code each stage changes, with the real
files' names and line numbers."""

import re
import shutil
import subprocess
import sys
from itertools import pairwise

import pytest
from helpers import REPO, STAGES
from test_budgets import code  # the rule that `make diff` follows

sys.path.insert(0, str(REPO / "tools"))
import stage_diff  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def make(*args):
    result = subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_help_describes_every_target():
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M)[1].split()
    described = dict(re.fullmatch(r"make (\S+) +(.+)", line).groups() for line in make("help").splitlines())
    assert sorted(described) == sorted(phony)
    assert all(described.values())


def test_diff_shows_train_py_code_at_its_real_lines():
    sections = re.split(r"^(?=--- )", make("diff"), flags=re.M)[1:]
    train = [s for s in sections if s.split("\n", 1)[0].endswith("/train.py")]
    differ = [(a, b) for a, b in pairwise(STAGES) if code(REPO / a / "train.py") != code(REPO / b / "train.py")]
    assert differ and [s.splitlines()[:2] for s in train] == [
        [f"--- {a}/train.py", f"+++ {b}/train.py"] for a, b in differ
    ]
    for section in train:
        for name, sign, start in zip(section.splitlines()[:2], "-+", (1, 2), strict=True):
            text = (REPO / name[4:]).read_text().splitlines()
            docstring = len(text) - len(code(REPO / name[4:]))  # its last line
            for hunk in re.split(r"^(?=@@ )", section, flags=re.M)[1:]:
                first = int(re.match(r"@@ -(\d+)\S* \+(\d+)\S* @@\n", hunk)[start])
                lines = [line[1:] for line in hunk.splitlines()[1:] if line[:1] in (" ", sign)]
                assert first > docstring  # the docstrings are left out
                assert text[first - 1 : first - 1 + len(lines)] == lines  # at the file's own line numbers


def test_scaling_and_clean_commands():
    scaling = make("-n", "PYTHON=python3", "scaling", "RUNS=runs/a runs/b", "BANDWIDTH=25", "ARGS=--target-accuracy 98")
    assert scaling == (
        "python3 tools/scaling.py --out scaling.md --plot scaling.png --bandwidth 25 --target-accuracy 98 runs/a runs/b\n"
    )
    profile = make("-n", "PYTHON=python3", "profile", "ARGS=--limit 5000")  # the classic loader's flags stay
    assert profile.splitlines()[-1].endswith("--loader classic --num-workers 1 --limit 5000")
    assert "--bandwidth" not in make("-n", "PYTHON=python3", "scaling", "RUNS=runs/a")
    assert {"scaling.md", "scaling.png", "plot.png"} <= set(make("-n", "clean").split())


def test_diff_names_each_pairs_idea_and_an_unchanged_train_py():
    shown = make("diff")
    headers = [line for line in shown.splitlines() if line.startswith("==== ")]
    assert headers[:4] == [f"==== {a} -> {b}: {stage_diff.idea(b)} ====" for a, b in pairwise(STAGES)]
    assert "04_ddp_multi_node/train.py: unchanged from 03_ddp_single_node: the lesson is in the job script" in shown
    assert not re.search(r"^(---|\+\+\+) .*\t", shown, re.M)  # no timestamps beside the file names
