"""Guard rail: any failure ends in one line. explain() tailors the line for the failures it knows; any
other exception that reaches rails.run(), of any class (a BaseException too), gets the line of described.py:
what, where in the user's code, and the file its traceback is kept in. No exception prints a traceback:
tests/test_one_line.py tries the hostile ones.

The lesson refuses a value, an object or a file with an ordinary exception whose message is the
whole line. refusal() knows it by where it was raised: a `raise` statement of the lesson (common/
outside these guard rails), so the lesson imports nothing of ours to be understood. The same classes
raised anywhere else (inside torch or Python, in the task's own code, in a call the lesson made) are
failures like any other: explain()'s line, or the fallback's, with the place and the traceback."""

import argparse
import linecache
import os
import pathlib
import re
import traceback
from pathlib import Path

import torch.distributed as dist

from common import distributed, optim
from common.environment import is_rank0
from common.guards import bounded, identity, misfits, ownership, safeload, workers, writes
from common.guards.described import LIMIT, alike, line, message, place
from common.guards.ending import Refusal
from common.guards.waits import fail
from common.guards.writes import free_mib, written

LESSON = Path(__file__).resolve().parents[1]  # common/
REFUSALS = (ValueError, TypeError, FileNotFoundError)  # the lesson's: a value or option, an object, a file


def raised_by(err, task):
    """Did the task file `task` itself raise `err` (its sys.exit(), not a signal handler's stop while it ran)?"""
    last = traceback.extract_tb(err.__traceback__)[-1:]
    return task is not None and bool(last) and Path(last[0].filename).resolve() == Path(task).resolve()


def exit_line(text):
    """A SystemExit's text as one `error:` line: the project's own are one already; a task's sys.exit("...")
    may be anything."""
    lines = [part.strip() for part in str(text).splitlines() if part.strip()] or ["(no message)"]
    if len(lines) == 1 and lines[0].startswith("error:"):
        return lines[0]
    text = " ".join(lines[0].split())
    return f"error: {text[:LIMIT]}{' [...]' if len(text) > LIMIT or len(lines) > 1 else ''}"


def refusal(err):
    """`error: ` and the message of the lesson's own refusal, or None for any other error. A refusal is
    one of REFUSALS raised by a `raise` statement in the lesson's code, its message naming cause and fix;
    not an OSError of the system (it has an errno), nor one raised inside a call the lesson made."""
    try:
        if not isinstance(err, REFUSALS) or getattr(err, "errno", None) or not err.__traceback__:
            return None
        last = traceback.extract_tb(err.__traceback__)[-1]
        path = Path(last.filename).resolve()
        if not path.is_relative_to(LESSON) or path.is_relative_to(LESSON / "guards"):
            return None
        source = linecache.getline(last.filename, last.lineno)
        colno = getattr(last, "colno", None)  # from Python 3.11: where on the line it was raised
        statement = source[colno:] if colno is not None else source.lstrip()
        said = " ".join(message(err).split())
        return f"error: {said}" if statement.startswith("raise ") else None
    except Exception:  # an error whose frames cannot be read: the fallback says it
        return None


# pathlib's files: one module to Python 3.12, a package from 3.13 (its read_bytes() in pathlib/_local.py)
PATHLIB = (pathlib.__file__, *(os.path.join(d, "") for d in pathlib.__spec__.submodule_search_locations or ()))


def loading_task(err):
    """Is `err` the failure to read the --task file itself (missing, a folder, a FIFO), not one of the task's own
    reads? cli.load_task()'s own read raised it (pathlib's, called from load_task()), or bounded.regular_file()
    before it, or Python's loader: the task never ran."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    raised, outside = frames[-1].filename if frames else "", [f for f in frames if not f.filename.startswith(PATHLIB)]
    read = raised.startswith(PATHLIB) and outside and outside[-1].name == "load_task"  # not the task's, as it runs
    read = read or raised.startswith("<frozen importlib") or raised == bounded.__file__
    return isinstance(err, OSError) and bool(read)


def clash(err):
    """The line for a task option that repeats a flag of the stage (argparse's conflict, raised at start)."""
    where = place(err)
    at = f", line {where[1]}" if where else ""
    return (
        f"error: --task {where[0] if where else ''}{at}: {message(err)}: a task's options must not repeat the "
        "stage's flags (see --help): rename it"
    )


def fallback(err, guard):
    """rails.run()'s line: once the ranks have met each says its own (it may be alone); before, rank 0 for all."""
    rank, args = distributed.launcher().rank, guard.args or argparse.Namespace(task=None, output_dir=None)
    locked = guard.lock is not None or guard.watchdog is not None  # the run took its folder: it exists
    owned = locked and (guard.claimed or free(args.output_dir))  # its own, or one holding no run's output
    said = line(err, args.task, args.output_dir if owned else None, rank)
    if guard.watchdog is None and not dist.is_initialized():
        return said if is_rank0() else 1  # as once()
    said = said.replace("error: ", f"error: rank {rank}: ", 1)
    return alike(guard.watchdog.failed(said), guard.watchdog) if guard.watchdog else said  # others name it


def in_thread(guard):
    """threading.excepthook for a run: an error in a thread (a task's, a library's) ends the run with one line
    naming the thread, as the main thread's would; the others then name this rank. A SystemExit ends its thread
    alone, as Python's own hook has it (the watchdog's threads end so)."""

    def hook(raised):
        if issubclass(raised.exc_type, SystemExit):
            return
        err, name = raised.exc_value, getattr(raised.thread, "name", "?")
        said = settle(err, guard)
        if not isinstance(said, str):  # a verdict rank 0 would say for all: this rank alone met it
            said = line(err, guard.args and guard.args.task, None, distributed.launcher().rank)
        said = said.replace("error: ", f"error: in thread {name}: ", 1)
        if guard.watchdog:
            guard.watchdog.failed(said)
        fail(said)

    return hook


def settle(err, guard):
    """explain()'s line, else the fallback's (fallback()): also where explaining fails (a str() that does)."""
    try:
        return explain(err, guard) or fallback(err, guard)
    except Exception:
        return fallback(err, guard)


def explain(err, guard):
    """One line for the errors a run meets from outside its code, or None."""
    if said := explain_task(err, guard):
        return said
    if guard.args is not None and (said := misfits.explain(err, guard.args.task)):  # a label, a collate()
        return said
    if guard.watchdog and (silent := guard.watchdog.explain(err)):  # a failed collective: who went silent
        return silent
    if said := workers.lost(err):  # its own line, or the connection it broke
        return said
    cause = safeload.first(err)  # stage 05's shards: the first rank's failure, which every rank is told
    if written(cause, guard.args and guard.args.output_dir) and (moved := guard.hold and identity.lost(guard.hold)):
        return moved  # the folder moved between the check before a save and its write: atomic() makes none, nor
        # stage 05's writer (common/sharded.py), whose parents DCP made again; the other ranks: the branch below
    if written(err, guard.args and guard.args.output_dir):  # checkpoint.atomic() removed its temporary file
        return writes.said(err, guard.args.output_dir if guard.args else ".")
    if type(err).__name__ == "CheckpointException":  # torch.distributed.checkpoint: every rank gets all failures
        verb, folder = (guard.doing or "read or write the checkpoint in --output-dir").split(" ", 1)
        if verb == "read":  # every rank gets every rank's failures: rank 0 says it
            return once(
                f"error: cannot load the checkpoint {folder}: {safeload.describe(err)}: resume from a complete one"
            )
        if not is_rank0():  # rank 0 says it (its folder may be gone: no free space to tell)
            return 1
        spare = free_mib(guard.args.output_dir)
        return once(
            f"error: could not write {folder}: {safeload.describe(err)} ({spare:.0f} MiB free there): the previous "
            "checkpoint is kept; free some space or choose another --output-dir, then resume"
        )
    frames = traceback.extract_tb(err.__traceback__)
    restoring = any(f.filename.endswith(("common/checkpoint.py", "/sharded.py", "/resuming.py")) for f in frames)
    if isinstance(err, RuntimeError) and message(err).startswith("Error(s) in loading state_dict") and restoring:
        said = " ".join(message(err).split()[4:])  # "for Net: size mismatch for fc.weight: ...": the keys
        return f"error: the checkpoint does not match this model: {said[:300]}{' [...]' if len(said) > 300 else ''}"
    if isinstance(err, RuntimeError) and "find_unused_parameters" in message(err):  # DDP's reducer, a flag of its own
        unused = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message(err))
        return (
            f"error: rank {distributed.launcher().rank}: the model has parameters that got no gradient in a step"
            f"{f' (indices {unused[1].strip()})' if unused else ''}: DDP needs every parameter in the loss each step; "
            "use them in forward() or drop them (TORCH_DISTRIBUTED_DEBUG=DETAIL names them)"
        )
    return None


def explain_task(err, guard):
    """One line for a task file that cannot be read, or whose model() or datasets() return what a stage cannot
    use, or None."""
    if isinstance(err, argparse.ArgumentError) and guard.args is None:  # the task's add_arguments()
        return once(clash(err))
    if guard.args is None and (isinstance(err, SyntaxError) or loading_task(err)):  # the task file
        where = f", line {err.lineno}" if isinstance(err, SyntaxError) else ""
        why = getattr(err, "strerror", None) or err.msg
        return once(f"error: --task {err.filename}{where}: {why}: give a task file as common/tasks/images.py is one")
    if isinstance(err, AttributeError) and getattr(err.obj, "__name__", "").startswith("task_"):
        return once(
            f"error: --task {err.obj.__file__} defines no {err.name}(): a task defines model(args) and "
            "datasets(args), as common/tasks/images.py does"
        )
    raised = traceback.extract_tb(err.__traceback__)[-1].line or ""  # the source line, where Python finds it
    if isinstance(err, AttributeError) and err.name == "to" and "task.model(" in raised:  # a stage's model line
        what = type(err.obj).__name__
        return once(f"error: --task {guard.args.task}: model(args) returned a {what}, not a torch.nn.Module")
    frames = traceback.extract_tb(err.__traceback__)
    optimizer = any(f.filename == optim.__file__ for f in frames)  # the lesson's, of model()'s parameters
    if "any parameter that requires a gradient" in message(err) or (  # DDP's, or the lesson's optimizer's
        isinstance(err, ValueError) and "empty parameter list" in message(err) and optimizer
    ):
        return once(
            f"error: --task {guard.args.task}: model(args) has no parameter that requires a gradient: nothing to train"
        )
    stepped = any(f.name == "train_step" for f in frames)  # a stage's backward()
    if "does not require grad and does not have a grad_fn" in message(err) and stepped:
        return once(
            f"error: --task {guard.args.task}: the loss depends on no parameter that requires a gradient: model(args) "
            "is frozen, or its forward() or the task's loss() detaches (torch.no_grad(), .detach(), .item())"
        )
    if isinstance(err, (TypeError, ValueError)) and "task.datasets(" in raised:  # unpacking what datasets() returned
        return once(
            f"error: --task {guard.args.task}: datasets(args) must return (training set, test set), two "
            f"torch.utils.data Datasets of (input, label) pairs ({message(err)})"
        )
    return None


def once(message):
    """A verdict every rank reaches alike: rank 0 says it, the others end with status 1."""
    return message if is_rank0() else 1


def free(folder):
    """Does `folder` hold no run's output (ownership.output()), as a folder a fresh run may take?"""
    try:
        return not ownership.output(folder)
    except Refusal:  # it cannot be listed
        return False
