"""Guard rail: a DataLoader worker that died is named, with its likely cause, however the loader met its end.

torch's loader names a dead worker when it notices: "DataLoader worker (pid(s) 812) exited unexpectedly",
caused by "... (pid 812) is killed by signal: Killed." But a worker killed while it sends a batch breaks
the connection before the kernel lets its end be seen: the loader finds it still alive and raises the
connection's error instead (a ConnectionResetError, seen once under load). lost() then asks torch's own
check of this process's workers, the one its SIGCHLD handler runs, until the end shows."""

import os
import re
import time
import traceback

from torch.utils.data._utils.signal_handling import _error_if_any_worker_fails

from common.guards.described import message

PATTERN = r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is )?(.*?)\.?\s*$"
BROKEN = (ConnectionError, EOFError)  # what reading from a worker that died raises
SHOWS = 2.0  # seconds for a killed worker's end to show: it is gone already, only not yet seen


def lost(err):
    """The line for a DataLoader worker that died, or None: out of memory only where SIGKILL ended it, as the
    kernel's killer does."""
    said = message(err.__cause__ or err) if isinstance(err, RuntimeError) else ""
    if not (found := re.match(PATTERN, said)) and isinstance(err, BROKEN) and from_loader(err):
        found = re.match(PATTERN, ended())
    if not found:
        return None
    why = "most likely the out-of-memory killer: use fewer --num-workers, or ask for more memory (#SBATCH --mem)"
    if "Killed" not in found[2]:
        why = "a crash in it (the task's data code, a library): --num-workers 0 shows it"
    return f"error: a DataLoader worker of this rank (pid {found[1]}) ended ({found[2]}): {why}; then continue with --resume"


def from_loader(err):
    """Was it raised reading from a DataLoader (torch/utils/data/ in its traceback)?"""
    return any(f"{os.sep}utils{os.sep}data{os.sep}" in f.filename for f in traceback.extract_tb(err.__traceback__))


def ended():
    """torch's line for a worker of this process that ended, waiting up to SHOWS seconds; "" if none did."""
    deadline = time.monotonic() + SHOWS
    while time.monotonic() < deadline:
        try:  # its line, raised (signals.hold() quieted its SIGCHLD handler, which raises it too)
            _error_if_any_worker_fails()
            time.sleep(0.05)
        except RuntimeError as err:
            return str(err)
    return ""
