"""Guard rail: a time limit, a preemption or a `scancel` loses at most the step in flight.

Slurm ends a job with SIGTERM (preemption, `scancel`, a requeue; KillWait later, SIGKILL), and the job
scripts pass on the time-limit signal they ask for; torchrun hands SIGTERM, SIGINT and SIGHUP on to its
workers. Any of them (signals.STOPS) is only noted when it arrives: every rank finishes the step it is in, and
the ranks agree, through the rendezvous store, on one step at which all of them stop. A rank proposes
the step after the one it is in; the others propose theirs when they hear of it (their own signal, or
the store, polled with every heartbeat); each rank waits for every proposal at its next step
boundary and stops at the largest. No rank can be past it (DDP keeps the ranks within a step of each
other) and no collective is added to a step. The guard rails then save the run mid-epoch and end it. A
second signal while that happens is noted and ignored. Without the store (rank 0, which served it, was
killed first) no step can be agreed: each rank left ends in one line, the last checkpoint kept. torchrun
hands SIGTERM on to its workers, and SIGUSR1 as the job scripts tell it to (torch >= 2.10); DataLoader
workers leave them to their rank (signals.shield_worker()). Evaluation batches count as steps here: they
continue the count of the epoch's steps."""

import datetime
import math
import os
import re
import signal
import subprocess
import threading
import time

import torch.distributed as dist

from common.distributed import print0
from common.environment import is_rank0
from common.guards.ending import stop
from common.guards.signals import Arrivals, Stopped, install, shield_worker
from common.guards.waits import fail

MARGIN = 30  # seconds beyond a save: the step in flight, the requeue, a save slower than the last


class Preemption:
    """This process's stop: the signal that came, the step it proposed, the step all ranks agreed on.
    `watchdog`: the process group's rendezvous (watchdog.Watchdog), or None without one; `timeout`: the
    longest wait for the other ranks' proposals."""

    def __init__(self, watchdog, timeout):
        self.watchdog, self.peers, self.timeout = watchdog, watchdog.peers() if watchdog else None, timeout
        self.signal, self.proposal, self.at, self.step = None, None, None, 0
        self.saved_at, self.warned = time.monotonic(), False
        self.once = threading.RLock()  # re-entrant: a second signal can interrupt the handler of the first
        # --checkpoint-minutes: the saves made so far; the one coming: heard of, this rank's proposal, the step
        # all agreed on; and the lock that keeps the heartbeat's thread and this one to one proposal
        self.timed = dict(round=0, heard=False, proposal=None, at=None, lock=threading.Lock())

    def catch(self):
        """From here on, a stop (SIGTERM, SIGUSR1, SIGINT, SIGHUP) ends the run at a step boundary, or between two
        evaluation batches, that every rank agrees on (signals.py says where else)."""
        self.arrivals = Arrivals()  # before the handlers: the first that comes is known
        if signum := install(self.received):  # a stop at start-up, dropped in a finalizer: still nothing saved
            raise Stopped(signum)
        os.register_at_fork(after_in_child=shield_worker)  # the DataLoader workers this process forks from now on

    def received(self, signum, frame):
        """The signal handler: note the first signal and propose a step; a second one changes nothing."""
        self.note(signal.Signals(self.arrivals.first(signum)).name)

    def note(self, name):
        """Note the signal that stops the run and propose this rank's step, once: the handler (main thread) and
        the listener (the heartbeat's) may both try; a proposal once read by another rank must never change."""
        with self.once:
            if self.signal is None:
                self.signal = name
                self.propose()

    def poll(self, store):
        """With every heartbeat: a rank whose signal is late (or never comes: a signal sent to one rank by hand)
        proposes its step as soon as another rank's proposal is in the store; likewise for a timed save."""
        if self.signal is None and store.check(["stop"]):
            self.note(store.get("stop").decode())  # another rank's signal: this one stops alike
        with self.timed["lock"]:
            if not self.timed["heard"] and store.check([f"save/{self.timed['round']}"]):
                self.offer()

    def propose(self):
        """This rank's stop step, after the signal is noted: the step after the last one it finished. The
        order (signal noted, then step read) makes it no earlier than the boundary where check() sees it."""
        self.proposal = self.step + 1
        if self.peers:
            store, rank, _ = self.peers
            try:
                store.set(f"stop/{rank}", str(self.proposal))
                store.set("stop", self.signal)
            except dist.DistError:  # rank 0 was killed first (srun then signals the others): in the handler, one line
                self.fail_without_store()

    def check(self, step):
        """At a step boundary, with `step` steps done (counted over the whole run): True where the run must stop
        and save. Two attribute reads per step while no signal has come."""
        self.step = step
        if self.signal is None:
            return False
        if self.at is None:
            self.at = self.agree()
        return step >= self.at

    def agree(self):
        """The stop step: the largest of every rank's proposals, waited for at most the timeout."""
        if not self.peers:
            return self.proposal
        store, rank, world_size = self.peers
        keys = [f"stop/{r}" for r in range(world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return max(int(store.get(key)) for key in keys)
        except dist.DistError:  # a timeout, or the store is gone
            pass
        try:
            missing = [k[5:] for k in keys if not store.check([k])]
        except dist.DistError:
            self.fail_without_store()
        stop(
            f"error: rank {rank}: {self.signal} came, but rank {', '.join(missing)} did not agree on a step to "
            f"stop at within --dist-timeout {self.timeout} s: the last checkpoint stays"
        )

    def fail_without_store(self):
        """End this rank in one line: the store, through which the ranks agree on the step to stop at, is gone."""
        fail(
            f"error: rank {self.peers[1]}: {self.signal} came, but {self.watchdog.store_gone()}: no step to stop "
            "at can be agreed, so nothing is saved: the last checkpoint stays; resume from it with --resume"
        )

    def exit_code(self):
        """A run stopped by a signal exits as the shell reports a process that signal ended: 128 + its number."""
        return 128 + signal.Signals[self.signal].value

    def saved(self, seconds):
        """Note a checkpoint just written: --checkpoint-minutes counts from here. Under Slurm, warn once if the
        job's signal comes too late for a save that takes `seconds` (the job scripts' --signal=B:USR1@90)."""
        self.saved_at = time.monotonic()
        if self.warned or not is_rank0() or "SLURM_JOB_ID" not in os.environ:
            return
        self.warned = True
        spec = job_signal(os.environ["SLURM_JOB_ID"])
        if spec and lead(spec) < lead_needed(seconds):
            print0(
                f"warning: a checkpoint takes {seconds:.0f} s here, and this job's signal (--signal={spec}) comes "
                f"{lead(spec)} s before its time limit: set #SBATCH --signal=B:USR1@{lead_needed(seconds)} or "
                "more, or the time limit may cut the last save short"
            )

    def due(self, minutes, step):
        """--checkpoint-minutes, at the end of every step (`step` counted as check() counts): True where every rank
        saves here. A rank whose own clock has run `minutes` since the last save proposes the step after this
        one; the others propose theirs when their own clocks or the store (polled with every heartbeat) tell
        them, and each saves at the largest proposal, as for a signal: no collective is added to a step, only a
        clock read. Without other ranks, this process's clock decides at once."""
        timed = self.timed
        if not timed["heard"] and time.monotonic() - self.saved_at < 60 * minutes:
            return False
        if not self.peers:
            return True
        with timed["lock"]:
            if not timed["heard"]:
                self.offer()
        if step < timed["proposal"]:
            return False
        if timed["at"] is None:
            timed["at"] = self.settle()
        if step < timed["at"]:
            return False
        with timed["lock"]:
            timed.update(round=timed["round"] + 1, heard=False, proposal=None, at=None)
        return True

    def offer(self):
        """Propose this rank's step for the coming timed save: the step after the last one it finished (noted
        first, then the step read, as in propose())."""
        timed, (store, rank, _) = self.timed, self.peers
        timed["heard"], timed["proposal"] = True, self.step + 1
        store.set(f"save/{timed['round']}/{rank}", str(timed["proposal"]))
        store.set(f"save/{timed['round']}", str(rank))

    def settle(self):
        """The step of the coming timed save: the largest of every rank's proposals, waited for at most the
        timeout."""
        (store, rank, world_size), round_ = self.peers, self.timed["round"]
        keys = [f"save/{round_}/{r}" for r in range(world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except dist.DistError:
            missing = [k.rpartition("/")[2] for k in keys if not store.check([k])]
            stop(
                f"error: rank {rank}: --checkpoint-minutes called for a save, but rank {', '.join(missing)} did not "
                f"agree on a step to save at within --dist-timeout {self.timeout} s: the last checkpoint stays"
            )
        return max(int(store.get(key)) for key in keys)


def job_signal(job):
    """The --signal of a Slurm job's script (Slurm shows it nowhere else; one given to sbatch's command line is
    not seen), or None."""
    try:
        script = subprocess.run(
            ["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return script_signal(script)


def script_signal(script):
    """The --signal of a batch script's #SBATCH lines, which sbatch reads up to its first command alone (one after
    `set -euo pipefail` was read as given: the doctor said PASS to a job Slurm never signals)."""
    for line in script.splitlines():
        if line.strip() and not line.startswith("#"):
            return None
        if found := re.match(r"#SBATCH.*--signal[= ](\S+)", line):
            return found[1]
    return None


def lead(spec):
    """The seconds before the time limit of a --signal value: B:USR1@90 -> 90 (Slurm's default is 60)."""
    return int(spec.rpartition("@")[2]) if "@" in spec else 60


def lead_needed(save_seconds):
    """The signal's lead a job needs, for a save that took `save_seconds`: the rule of the run and the doctor."""
    return math.ceil(save_seconds) + MARGIN
