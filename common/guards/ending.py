"""Guard rail: how a process ends. A guard rail refuses with one exception, Refusal, whose line rails.run() says;
a verdict every rank reached alike is said once, by rank 0 (stop()); a rank of a process group ends without the
interpreter's teardown (end())."""

import atexit
import multiprocessing
import os
import signal
import sys
import threading
import traceback

from common.environment import is_rank0
from common.guards.signals import STOPS


class Refusal(SystemExit):
    """A guard rail's refusal, raised where a check finds what is wrong: `line`, the one line that says it and
    what to do ("error: ..."), which rails.run() says and ends the process with status 1; or the exit status
    alone where the line is said already (a usage error, check.usage(): 2). `once`: a verdict every rank reached
    alike, which rank 0 alone says (the others end with status 1). A SystemExit: a tool that calls a guard rail
    outside rails.run() still ends with the line, as Python ends any SystemExit, and no caller's `except
    Exception` takes it for a failure of its own."""

    def __init__(self, line, once=False):
        super().__init__(1 if once and not is_rank0() else line)
        self.line = line if isinstance(line, str) else None  # told to the others where this rank met it alone


def stop(message):
    """End every rank, which all reached the same verdict; rank 0 alone says why."""
    raise Refusal(message, once=True)


def end(code, joined):
    """End the process with `code`, an exit status or a message for stderr (then status 1), as SystemExit does.
    A rank that `joined` a process group skips the interpreter's teardown: there, a thread that returns from
    C++ into Python is stopped inside C++, which aborts the process (SIGABRT, "terminate called without an
    active exception") after a run that succeeded. gloo's threads do that when they release a finished
    collective's tensor. So does a process that a task's thread would keep alive (Python's teardown waits for
    every thread not a daemon: the run would print its verdict and never end). Otherwise Python ends the run as
    usual (kernprof writes its profile after it). From here on a signal that stops a run ends it at once with
    the status decided (Slurm's SIGTERM again, a second Ctrl-C): it never changes the status; after the last exit
    function, in Python's teardown, it is ignored (signals.end_at_once())."""
    status = code if isinstance(code, int) else int(code is not None)
    for signum in STOPS:
        signal.signal(signum, lambda *_: os._exit(status))
    sys.unraisablehook = exit_function_failed
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler raises when a DataLoader worker is killed
    for child in multiprocessing.active_children():  # DataLoader workers that a failure's traceback still holds:
        child.kill()  # they let SIGTERM pass (signals.shield_worker), and multiprocessing's exit would wait for ever
    if not joined and not lingering():
        if code:
            raise SystemExit(code) from None
        return
    if not isinstance(code, int | None):
        print(code, file=sys.stderr)
    atexit._run_exitfuncs()  # what the teardown runs first: line_profiler's report under LINE_PROFILE=1
    for stream in (sys.stdout, sys.stderr):  # None when started with the descriptor closed (>&-)
        try:
            stream and stream.flush()
        except (OSError, ValueError):  # a pipe whose reader left (| head): the run's own files are whole
            pass
    os._exit(status)


def exit_function_failed(unraisable):
    """After the verdict: an exit function that raised (a task's atexit.register()) is one line and status 1, not
    Python's "Exception ignored" traceback under the status decided; any other unraisable error as Python says it."""
    if not (unraisable.err_msg or "").startswith("Exception ignored in atexit callback"):
        return sys.__unraisablehook__(unraisable)
    err, frames = unraisable.exc_value, traceback.extract_tb(unraisable.exc_traceback)
    at = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    print(f"error: an exit function raised {type(err).__name__}: {err}{at}", file=sys.stderr, flush=True)
    os._exit(1)


def lingering():
    """The threads, not daemons, that Python's teardown would wait for (a task's, a library's): their names."""
    main = threading.main_thread()
    return [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
