"""Guard rail: how a run ends. `run(main)` is the last line of every stage: Ctrl-C, and a DataLoader worker
killed under it (most often by the out-of-memory killer), each end the run with one line that says what
happened and what to do, instead of a traceback. Nothing is lost that a checkpoint holds: the last finished
epoch stays in --output-dir. A rank of a process group then ends without the interpreter's teardown (end()).
DataLoader workers leave the signals that stop a run to their rank (shield_worker())."""

import atexit
import multiprocessing
import os
import re
import signal
import sys
import threading

from common import watchdog
from common.environment import is_rank0


def run(main):
    try:
        main()
    except KeyboardInterrupt:
        if is_rank0():  # Ctrl-C reaches every rank of the terminal's launch: one says it
            print("error: interrupted (Ctrl-C): the checkpoint of the last finished epoch is kept in --output-dir: "
                  "continue with --resume", file=sys.stderr, flush=True)  # fmt: skip
        end(130)  # the shell's code for a run ended by SIGINT
    except RuntimeError as err:
        # "DataLoader worker (pid(s) 812) exited unexpectedly", caused by "... (pid 812) is killed by signal: Killed."
        lost = re.match(
            r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is )?(.*?)\.?\s*$", str(err.__cause__ or err)
        )
        if not lost:
            raise
        end(
            f"error: a DataLoader worker of this rank (pid {lost[1]}) ended ({lost[2]}), most likely killed by the "
            "out-of-memory killer: use fewer --num-workers, or ask for more memory (#SBATCH --mem); then continue "
            "with --resume"
        )
    except SystemExit as stop:
        end(stop.code)
    end(0)


def end(code):
    """End the process with `code`, an exit status or a message for stderr (then status 1), as SystemExit does.
    A rank of a process group skips the interpreter's teardown: there, a thread that returns from C++ into
    Python is stopped inside C++, which aborts the process (SIGABRT, "terminate called without an active
    exception") after a run that succeeded. gloo's threads do that when they release a finished collective's
    tensor. Without a process group, Python ends the run as usual (kernprof writes its profile after it).
    From here on the signals that stop a run are ignored: the status is decided, and a late one (Slurm's
    SIGTERM again, a second Ctrl-C) would end the process by the signal instead, Python's teardown having
    given them back their default action."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    if not watchdog.joined():
        if code:
            raise SystemExit(code) from None
        return
    if not isinstance(code, int | None):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # what the teardown runs first: line_profiler's report under LINE_PROFILE=1
    for stream in (sys.stdout, sys.stderr):  # None when started with the descriptor closed (>&-)
        try:
            stream and stream.flush()
        except (OSError, ValueError):  # a pipe whose reader left (| head): the run's own files are whole
            pass
    os._exit(code or 0)


def shield_worker(worker_id):
    """A DataLoader worker's start (worker_init_fn): the signals that stop a run are its rank's to handle.
    Slurm sends them to every process of a step, Ctrl-C to the process group, torchrun to each worker's
    group: a worker they ended would end the run unsaved ("killed by signal: Terminated"). The worker ignores
    them, but for its rank's own SIGTERM, torch's way of ending it (at the latest at the rank's exit)."""
    for signum in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # and in every thread started here: drop() takes it
    rank = multiprocessing.parent_process().pid

    def drop():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank:
            pass
        os._exit(0)  # as torch's own handler ends a worker

    threading.Thread(target=drop, daemon=True).start()
