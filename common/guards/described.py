"""Guard rail: the one line for an exception none of the guard rails knows (failure.explain()), of any class (a
BaseException too): its type, its message (one line, bounded) and the place in the user's code that raised it,
the task file's line where the task raised it; the full traceback is kept in a file the line names (a run's: in
its output folder, traceback-rank<N>.txt; a tool's: in TMPDIR). A failure every rank meets alike is said once
(alike())."""

import os
import re
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

import torch

from common.checkpoint import atomic
from common.guards.waits import within

LIMIT = 300  # characters of a message in the line: a tensor printed into one would fill the log


def libraries():
    """Folders of code that is nobody's own here: Python's, the installed packages', torch's."""
    paths = sysconfig.get_paths()
    return tuple({paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {os.path.dirname(torch.__file__)})


def frames(err):
    """(file, line, function) of each frame that raised `err`, outermost first, then of its cause (`raise ... from`);
    then those of a traceback that came as text in its message, innermost: a DataLoader worker's error."""
    tracebacks = [err.__traceback__] + ([err.__cause__.__traceback__] if err.__cause__ else [])
    found = [(f.filename, f.lineno, f.name) for tb in tracebacks for f in traceback.extract_tb(tb)]
    text = message(err)
    return found + [(m[1], int(m[2]), m[3]) for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', text)]


def place(err, task=None):
    """Where in the user's code `err` was raised: the innermost frame in the task file `task`, else the
    innermost outside Python, the installed packages and torch; None where every frame is theirs."""
    ours = [f for f in frames(err) if not f[0].startswith(("<", *libraries()))]
    mine = [f for f in ours if task is not None and Path(f[0]).resolve() == Path(task).resolve()]
    return (mine or ours or [None])[-1]


def message(err):
    """str(err), whatever its class makes of it: a __str__ that fails is no second failure."""
    try:
        return str(err)
    except Exception:  # the user's exception class: anything can fail in it
        return "(its message cannot be printed)"


def summary(err):
    """`Type: message` on one line: the first line of the message, or a DataLoader worker's last (its own
    error), blanks squeezed, at most LIMIT characters; the type alone where the message is empty."""
    lines = [line for line in message(err).splitlines() if line.strip()]
    if "Original Traceback" in message(err):
        lines = lines[-1:]
    text = " ".join(lines[0].split()) if lines else ""
    text = text[:LIMIT] + " [...]" if len(text) > LIMIT or len(lines) > 1 else text
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def keep(err, path):
    """The full traceback in the file `path`, switched in whole (a link there replaced, never followed), or None."""
    try:
        with atomic(path, "w") as f:
            f.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    except OSError:  # a full disk, a folder gone: the line is still said
        return None
    return path


def line(err, task, folder, rank):
    """The one line for `err`: what, where in the user's code, where its traceback is kept (`folder`, if one)."""
    kept = keep(err, Path(folder) / f"traceback-rank{rank}.txt") if folder is not None else None
    return f"error: {described(err, task, kept)}: fix it and run again (with --resume once a checkpoint is saved)"


def tool_line(err):
    """A tool's one line for an error none of its checks names (early.tool()), its traceback kept in TMPDIR."""
    tool = Path(sys.argv[0]).stem
    kept = keep(err, Path(tempfile.gettempdir()) / f"traceback-{tool}-{os.getpid()}.txt")
    return f"error: {described(err, None, kept)}: {tool} met what none of its checks knows"


def described(err, task, kept):
    """What `err` is, where in the user's code it was raised, and the file its traceback is kept in (or None)."""
    where = place(err, task)
    at = f" (at {where[0]}:{where[1]}, in {where[2]})" if where else ""
    return f"{summary(err)}{at}{f'; the traceback is in {kept}' if kept else ''}"


def alike(said, dog, seconds=2.0):
    """A failure every rank meets (a task's missing file, a package it lacks), said once: rank 0 waits `seconds` at
    most for the others' lines in the store (watchdog.failed()); all alike but for the rank, its line says "on every
    rank" and the others say nothing (exit status 1). One rank's own failure, or a store gone: each its own line."""
    same = re.sub(r"\brank\d*\b ?\d*", "rank", said[:500])  # error: rank 3: ... traceback-rank3.txt (as stored)
    deadline, ranks = time.monotonic() + seconds, [0] if dog.rank else range(1, dog.world_size)
    lines = {}
    while len(lines) < len(ranks) and time.monotonic() < deadline:
        for r in (r for r in ranks if r not in lines):
            if within(1, lambda r=r: dog.store.check([f"failed/{r}"])):
                lines[r] = within(1, lambda r=r: dog.store.get(f"failed/{r}").decode())
        time.sleep(0.05)
    if len(lines) < len(ranks) or any(re.sub(r"\brank\d*\b ?\d*", "rank", x or "") != same for x in lines.values()):
        return said
    return 1 if dog.rank else said.replace("error: rank 0: ", "error: on every rank: ", 1)
