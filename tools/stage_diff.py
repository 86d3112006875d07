"""What each stage adds to the one before, for a projector: `make diff`, or python tools/stage_diff.py.

For every pair of neighbouring stages: a header naming the later stage's idea (the first line of its
docstring), then its train.py against the earlier one's, the opening docstrings left out and the line
numbers those of the files, and its job script; unified diffs without timestamps. Where train.py did not
change, it says so: the lesson is in the job script. Needs the standard library only.
"""

import ast
import difflib
import os
import re
import sys
from itertools import pairwise
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGES = ["01_single_gpu", "02_dataparallel", "03_ddp_single_node", "04_ddp_multi_node", "05_fsdp"]


def code(path):
    """(lines of the opening docstring, the lines after it) of a Python file."""
    lines = path.read_text().splitlines(keepends=True)
    first = ast.parse("".join(lines)).body[0]
    skip = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else 0
    return skip, lines[skip:]


def idea(stage):
    """The stage's idea, from its docstring's first line: "Stage 03: one process per GPU, ..." -> "one ..."."""
    return (
        ast.get_docstring(ast.parse((REPO / stage / "train.py").read_text()))
        .splitlines()[0]
        .split(": ", 1)[-1]
        .rstrip(".")
    )


def unified(a, b, name_a, name_b, skip_a=0, skip_b=0):
    """The unified diff of two lists of lines, hunks numbered as in the files (after `skip` lines)."""
    for line in difflib.unified_diff(a, b, name_a, name_b):
        m = re.fullmatch(r"@@ -(\d+)(\S*) \+(\d+)(\S*) @@\n", line)
        yield f"@@ -{int(m[1]) + skip_a}{m[2]} +{int(m[3]) + skip_b}{m[4]} @@\n" if m else line


def pair(a, b):
    yield f"\n==== {a} -> {b}: {idea(b)} ====\n"
    (skip_a, train_a), (skip_b, train_b) = code(REPO / a / "train.py"), code(REPO / b / "train.py")
    changed = list(unified(train_a, train_b, f"{a}/train.py", f"{b}/train.py", skip_a, skip_b))
    yield from changed or [f"{b}/train.py: unchanged from {a}: the lesson is in the job script\n"]
    job_a, job_b = (REPO / s / "job.slurm" for s in (a, b))
    yield from unified(
        job_a.read_text().splitlines(True), job_b.read_text().splitlines(True), f"{a}/job.slurm", f"{b}/job.slurm"
    )


def main():
    for a, b in pairwise(STAGES):
        sys.stdout.writelines(pair(a, b))
    sys.stdout.write("\n==== 04_ddp_multi_node: job.slurm (srun) -> job_torchrun.slurm (one torchrun per node) ====\n")
    scripts = [(REPO / "04_ddp_multi_node" / name) for name in ("job.slurm", "job_torchrun.slurm")]
    sys.stdout.writelines(
        unified(*(s.read_text().splitlines(True) for s in scripts), *(f"04_ddp_multi_node/{s.name}" for s in scripts))
    )


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # it takes no arguments: its help is its docstring
        sys.exit(print(__doc__))
    if sys.argv[1:]:
        sys.exit(f"error: tools/stage_diff.py takes no arguments: {' '.join(sys.argv[1:])}")
    try:
        main()
    except BrokenPipeError:  # its reader went (`| head`): the rest unread, as after SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit fails no more
        sys.exit(128 + 13)
