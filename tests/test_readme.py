"""The READMEs say what the code does: every message Troubleshooting quotes is one the code prints, and
every command of theirs that a CPU runs in seconds runs as written."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def printed():
    """Every string literal of the stages, common/ and tools/, f-string fields replaced by a NUL: what the
    code can print, with what varies cut out (adjacent literals are joined by the parser)."""
    texts = []
    for path in [*REPO.glob("0*/train.py"), *REPO.glob("common/**/*.py"), *REPO.glob("tools/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                texts.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return texts


def test_every_troubleshooting_heading_is_a_line_the_code_prints():
    section = (REPO / "README.md").read_text().split("## Troubleshooting\n")[1].split("\n## ")[0]
    quoted = re.findall(r"^- \*\*`([^`]+)`", section, re.M)
    assert len(quoted) >= 5
    texts = printed()
    for message in quoted:
        assert any(message in text for text in texts), message
    assert not any("Address already in use" in text for text in texts)  # torch's words, which the run replaces


SAFE = re.compile(r"--limit|--help|--check\b(?!-)|make (help|diff)\b")  # what a CPU runs in seconds


def fenced_commands():
    """(README, command) for every line of a ```bash block in the READMEs that is safe to run on a CPU."""
    for path in [REPO / "README.md", *sorted(REPO.glob("0*/README.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                command = line.split("  #")[0].strip()
                if SAFE.search(command):
                    yield path, command


# another task's commands run in make test-all: test_tasks.py runs that task in make test
COMMANDS = [pytest.param(*rc, marks=pytest.mark.slow) if "tasks/" in rc[1] else rc for rc in fenced_commands()]


@pytest.mark.parametrize("readme, command", COMMANDS, ids=lambda x: str(x)[-40:])
def test_the_readmes_commands_run(readme, command, tiny_data, tmp_path):
    """As written, from the README's folder: the environment's own bin/ for .venv/bin/, a stage on the tiny
    data set into a folder of its own, make with this Python."""
    command = command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    if "train.py" in command:
        command += f" --data-dir {tiny_data} --output-dir {tmp_path / 'out'}"
    if command.startswith("make "):
        command += f" PYTHON={sys.executable}"
    out = subprocess.run(["bash", "-c", command], cwd=readme.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_quick_start_is_among_them():
    assert any("--nproc_per_node=2" in command and "--limit" in command for _, command in fenced_commands())
