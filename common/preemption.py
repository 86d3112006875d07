"""Guard rail: a time limit, a preemption or a `scancel` loses at most the step in flight.

Slurm ends a job with SIGTERM (preemption, `scancel`, a requeue; KillWait later, SIGKILL), and the job
scripts pass on the time-limit signal they ask for; torchrun hands SIGTERM on to its workers, and SIGUSR1
as the job scripts tell it to (torch >= 2.10); DataLoader workers leave both to their rank. Either
signal, SIGTERM or SIGUSR1, is only noted when it arrives: every rank finishes the step it is in, and
the ranks agree, through the rendezvous store, on one step at which all of them stop. A rank proposes
the step after the one it is in; the others propose theirs when they hear of it (their own signal, or
the store, polled with every heartbeat); each rank waits for every proposal at its next step
boundary and stops at the largest. No rank can be past it (DDP keeps the ranks within a step of each
other) and no collective is added to a step. common/checkpoint.py then saves the run mid-epoch and ends
it. A second signal while that happens is noted and ignored. Without the store (rank 0, which served it,
was killed first) no step can be agreed: each rank left ends in one line, the last checkpoint kept."""

import datetime
import math
import os
import re
import signal
import subprocess
import threading
import time

import torch.distributed as dist

from common import watchdog
from common.distributed import print0, stop
from common.environment import is_rank0

_stop = {"signal": None, "at": None, "step": 0, "saved": time.monotonic(), "warned": False}  # this process's alone
_once = threading.RLock()  # re-entrant: a second signal can interrupt the handler of the first
MARGIN = 30  # seconds beyond a save: the step in flight, the requeue, a save slower than the last


def catch(timeout):
    """From here on, SIGTERM and SIGUSR1 stop the run at a step boundary that every rank agrees on (check());
    `timeout`: the longest wait for the other ranks' proposals."""
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, received)
    _stop["timeout"] = timeout
    if watchdog.peers():  # a rank may hear of the stop from the store before its own signal arrives
        watchdog.listen(poll)


def received(signum, frame):
    """The signal handler: note the first signal and propose a step; a second one changes nothing."""
    note(signal.Signals(signum).name)


def note(name):
    """Note the signal that stops the run and propose this rank's step, once: the handler (main thread) and
    the listener (its own) may both try; a proposal once read by another rank must never change."""
    with _once:
        if _stop["signal"] is None:
            _stop["signal"] = name
            propose()


def poll(store):
    """With every heartbeat: a rank whose signal is late (or never comes: a signal sent to one rank by hand)
    proposes its step as soon as another rank's proposal is in the store."""
    if _stop["signal"] is None and store.check(["stop"]):
        note(store.get("stop").decode())  # another rank's signal: this one stops alike


def propose():
    """This rank's stop step, after the signal is noted: the step after the last one it finished. The
    order (signal noted, then step read) makes it no earlier than the boundary where check() sees it."""
    _stop["proposal"] = _stop["step"] + 1
    if peers := watchdog.peers():
        store, rank, _ = peers
        try:
            store.set(f"stop/{rank}", str(_stop["proposal"]))
            store.set("stop", _stop["signal"])
        except dist.DistError:  # rank 0 was killed first (srun then signals the others): in the handler, one line
            fail_without_store(rank)


def check(step):
    """At a step boundary, with `step` steps done (counted over the whole run): True where the run must stop
    and save. Two dictionary reads per step while no signal has come."""
    _stop["step"] = step
    if _stop["signal"] is None:
        return False
    if _stop["at"] is None:
        _stop["at"] = agree()
    return step >= _stop["at"]


def agree():
    """The stop step: the largest of every rank's proposals, waited for at most the timeout."""
    peers = watchdog.peers()
    if not peers:
        return _stop["proposal"]
    store, rank, world_size = peers
    keys = [f"stop/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=_stop["timeout"]))
        return max(int(store.get(key)) for key in keys)
    except dist.DistError:  # a timeout, or the store is gone
        pass
    try:
        missing = [k[5:] for k in keys if not store.check([k])]
    except dist.DistError:
        fail_without_store(rank)
    stop(f"error: rank {rank}: {_stop['signal']} came, but rank {', '.join(missing)} did not agree on a step to "
         f"stop at within --dist-timeout {_stop['timeout']} s: the last checkpoint stays")  # fmt: skip


def fail_without_store(rank):
    """End this rank in one line: the store, through which the ranks agree on the step to stop at, is gone."""
    watchdog.fail(f"error: rank {rank}: {_stop['signal']} came, but {watchdog.store_gone()}: no step to stop at "
                  "can be agreed, so nothing is saved: the last checkpoint stays; resume from it with --resume")  # fmt: skip


def signalled():
    """The name of the signal that stops this run, or None."""
    return _stop["signal"]


def exit_code():
    """A run stopped by a signal exits as the shell reports a process that signal ended: 128 + its number."""
    return 128 + signal.Signals[_stop["signal"]].value


def saved(seconds):
    """Note a checkpoint just written: --checkpoint-minutes counts from here. Under Slurm, warn once if the
    job's signal comes too late for a save that takes `seconds` (the job scripts' --signal=B:USR1@90)."""
    _stop["saved"] = time.monotonic()
    if _stop["warned"] or not is_rank0() or "SLURM_JOB_ID" not in os.environ:
        return
    _stop["warned"] = True
    spec = job_signal(os.environ["SLURM_JOB_ID"])
    if spec and lead(spec) < lead_needed(seconds):
        print0(f"warning: a checkpoint takes {seconds:.0f} s here, and this job's signal (--signal={spec}) comes "
               f"{lead(spec)} s before its time limit: set #SBATCH --signal=B:USR1@{lead_needed(seconds)} or more, "
               "or the time limit may cut the last save short")  # fmt: skip


def job_signal(job):
    """The --signal of a Slurm job's script (Slurm shows it nowhere else; one given to sbatch's command line is
    not seen), or None."""
    try:
        script = subprocess.run(["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True,
                                timeout=10).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^#SBATCH.*--signal[= ](\S+)", script, re.M)
    return found and found[1]


def lead(spec):
    """The seconds before the time limit of a --signal value: B:USR1@90 -> 90 (Slurm's default is 60)."""
    return int(spec.rpartition("@")[2]) if "@" in spec else 60


def lead_needed(save_seconds):
    """The signal's lead a job needs, for a save that took `save_seconds`: the rule of the run and the doctor."""
    return math.ceil(save_seconds) + MARGIN


def due(minutes, step):
    """--checkpoint-minutes, at the end of every step (`step` counted as check() counts): True where every rank
    saves here. A rank whose own clock has run `minutes` since the last save proposes the step after this one;
    the others propose theirs when their own clocks or the store (polled with every heartbeat) tell them, and
    each saves at the largest proposal, as for a signal (check()): no collective is added to a step, only a
    clock read. Without other ranks, this process's clock decides at once."""
    timed = _stop.get("timed")
    if timed is None:  # the first step: from now on, hear of the other ranks' saves
        # the saves made so far; the one coming: heard of, this rank's proposal, the step all agreed on; and the
        # lock that keeps the heartbeat's thread and this one to one proposal
        timed = _stop["timed"] = dict(peers=watchdog.peers() or (), round=0, heard=False, proposal=None, at=None,
                                      lock=threading.Lock())  # fmt: skip
        if timed["peers"]:
            watchdog.listen(hear)
    if not timed["heard"] and time.monotonic() - _stop["saved"] < 60 * minutes:
        return False
    if not timed["peers"]:
        return True
    with timed["lock"]:
        if not timed["heard"]:
            offer(timed)
    if step < timed["proposal"]:
        return False
    if timed["at"] is None:
        timed["at"] = settle(timed)
    if step < timed["at"]:
        return False
    with timed["lock"]:
        timed.update(round=timed["round"] + 1, heard=False, proposal=None, at=None)
    return True


def hear(store):
    """With every heartbeat: a rank whose own clock has not called for the save yet proposes its step as soon as
    another rank's proposal is in the store."""
    timed = _stop["timed"]
    with timed["lock"]:
        if not timed["heard"] and store.check([f"save/{timed['round']}"]):
            offer(timed)


def offer(timed):
    """Propose this rank's step for the coming save: the step after the last one it finished. As in propose(),
    noted first, then the step read: no earlier than the boundary where due() sees it."""
    timed["heard"] = True
    timed["proposal"] = _stop["step"] + 1
    store, rank, _ = timed["peers"]
    store.set(f"save/{timed['round']}/{rank}", str(timed["proposal"]))
    store.set(f"save/{timed['round']}", str(rank))


def settle(timed):
    """The step of the coming save: the largest of every rank's proposals, waited for at most --dist-timeout."""
    store, rank, world_size = timed["peers"]
    keys = [f"save/{timed['round']}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=_stop["timeout"]))
    except dist.DistError:
        missing = [k.rpartition("/")[2] for k in keys if not store.check([k])]
        stop(f"error: rank {rank}: --checkpoint-minutes called for a save, but rank {', '.join(missing)} did not "
             f"agree on a step to save at within --dist-timeout {_stop['timeout']} s: the last checkpoint stays")  # fmt: skip
    return max(int(store.get(key)) for key in keys)
