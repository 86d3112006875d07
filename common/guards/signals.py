"""Guard rail: the signals that stop a run, wherever they find it. A stop is honoured at every safe point:

  start-up        the imports, the options, the rendezvous, the data, its fingerprint, the model: until resume()
                  the run has saved nothing and can lose nothing, so a stop ends it at once, in one line, with
                  128 + the signal's number (end_at_once(), then stop_at_once()); the same command starts it again
  a training step from resume() on, the signal is only noted: every rank finishes its step, all agree on one
                  step to stop at, save there and end (preemption.Preemption, rails.Guard.end_of_step())
  an evaluation   likewise between evaluation batches (rails.Guard.end_of_batch()): the epoch's training is
                  saved whole, and the resumed run evaluates the epoch again
  a save, the     noted, and acted on at the next step or evaluation batch; after the last epoch's evaluation
  epoch's end     there is none: the run ends as it would have, its last checkpoint complete

SIGTERM (Slurm, torchrun, `kill`), SIGUSR1 (the job scripts' time-limit signal), SIGINT (Ctrl-C, which a terminal
sends to every process of its launch) and SIGHUP (a closed ssh session) are one stop: the first one counts, the
status is 128 + its number. DataLoader workers leave them to their rank, and the programs those start get the
default handling back (shield_worker()). The tests that prove each: tests/FAILURES.md, "Signals"."""

import atexit
import os
import signal
import sys

from common.environment import is_rank0

STOPS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class Stopped(BaseException):
    """A stop before the run could save anything: rails.run() ends the run with its line and status. A request,
    not an error, as the line of a stop that saved is: no `error:` (srun ends a step's other tasks with SIGTERM when
    one fails, and the failing one's line must stay the only error of the job)."""

    def __init__(self, signum):
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} during start-up, before the first step: nothing was saved and nothing "
            "is lost; start the run again as it was started"
        )
        self.code = 128 + signum


class SavedStop(BaseException):
    """A stop that every rank agreed on and saved for (saving.Saving.stop_or_save()): it leaves the
    training loop, and rails.run() ends the run with `code`, 128 + the signal's number. A BaseException,
    as a stop is no error: nothing on its way out catches it."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


class AtOnce:
    """The stops' handler until resume(): `end(signum)` ends the run where it is. It keeps the first signal: what a
    handler raises while Python runs a finalizer (a __del__, a weakref callback: wherever the collector runs) is
    printed as "Exception ignored" and dropped, and the run trained on to its end, the stop lost, status 0. The
    next phase's handler takes it from there (install()) and ends the run then."""

    def __init__(self, end):
        self.end, self.signum = end, None

    def __call__(self, signum, frame):
        first = self.signum is None
        self.signum = self.signum or signum
        if first or self.end is raise_stopped:  # a later exit_stopped: the first's exit is under way
            self.end(self.signum)


def install(handler):
    """`handler` for every stop; returns the stop the start-up handler it replaces took, or None. Read after, as
    one that came in between found the old handler; the run still here to read it, that handler's end was dropped."""
    before = signal.getsignal(STOPS[0])
    for signum in STOPS:
        signal.signal(signum, handler)
    return before.signum if isinstance(before, AtOnce) else None


def stop_at_once():
    """Until resume() catches them (Preemption.catch()): a stop ends the run wherever it is, in one line."""
    if signum := install(AtOnce(raise_stopped)):  # an import's stop, its exit dropped: its line was said
        sys.exit(128 + signum)


class Arrivals:
    """The order the stops came in. Python runs the handlers of signals that came while it was in C (a matmul, a
    collective, a save) by their numbers, not in the order they came: SIGHUP's before SIGTERM's, and the run said
    "(SIGHUP)" and ended with 129 for a scancel's SIGTERM. The C handler writes each signal's number to a wakeup
    pipe as it comes (signal.set_wakeup_fd), which first() reads."""

    def __init__(self):
        self.read, write = os.pipe()
        for fd in (self.read, write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def first(self, signum):
        """The first stop that came since the last call (the handler of `signum` runs), else `signum`."""
        came = b""
        try:
            while chunk := os.read(self.read, 4096):  # all of it: SIGCHLD's bytes too, a worker's end
                came += chunk
        except BlockingIOError:  # read to its end
            pass
        return next((n for n in came if n in STOPS), signum)


def failure(call):
    """What call() raised, or None. A signal pending as it fails (it arrived while the process waited in C, in a
    collective that then failed) is raised where Python next looks for one: from 3.11 at the next call, which
    rails.run() makes where it catches them (hold()); on 3.10 as the except clause below begins. There, a stop
    stands for the failure, as in run() (the stop is why), and torch's SIGCHLD line leaves it its own."""
    try:
        try:
            call()
        except BaseException as raised:
            return raised
    except Stopped as stop:  # Python 3.10
        return stop
    except BaseException as late:  # Python 3.10: torch's SIGCHLD handler, raised while the failure was handled
        return late.__context__ or late
    return None


def hold():
    """While rails.run() reaches its verdict on a failure: a stop is noted, not raised into the code that
    explains the failure (a traceback instead of its line); end() then ends the run with the status decided.
    Nor is torch's line for a DataLoader worker that ended (its SIGCHLD handler, which raises it wherever this
    process is, in place of the failure's line): workers.lost() asks torch's check of the workers itself."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN if signal.getsignal(signum) is signal.SIG_IGN else noted)


def noted(signum, frame):
    """A stop during the verdict on a failure: the failure's line and status stand."""


def raise_stopped(signum):
    raise Stopped(signum)


def end_at_once():
    """From a stage's first line (early.start()) until run() takes over with stop_at_once(): the imports, where no
    one could catch a Stopped. A stop exits with the same line and status, not a traceback out of an import."""
    install(AtOnce(exit_stopped))  # the first stop counts: a second Ctrl-C does not say it again
    sys.unraisablehook = dropped(sys.unraisablehook)
    atexit.register(ignore_stops)  # the last exit function: the teardown after it resets each handler to the default


def ignore_stops():
    """After the exit functions (a task's, line_profiler's): a stop no longer changes the status decided. Python's
    teardown resets every handler it set to the default, whose SIGTERM ended a finished run with 143 and no line;
    ignored signals it leaves so. Until then a stop still ends a run that an exit function holds."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)


def exit_stopped(signum):
    sys.exit(say(Stopped(signum)))


def dropped(hook):
    """`hook` for what Python drops, but a stop AtOnce raised in a finalizer: no traceback, AtOnce kept it."""

    def unless_a_stop(unraisable):
        tb = unraisable.exc_traceback
        while tb and tb.tb_frame.f_code is not AtOnce.__call__.__code__:
            tb = tb.tb_next
        if tb is None:
            hook(unraisable)

    return unless_a_stop


def end_tool():
    """A tool's (early.tool()): a stop ends it wherever it is, in one line; the status is 128 + its number."""
    for signum in STOPS:
        signal.signal(signum, exit_tool)


def exit_tool(signum, frame):
    for later in STOPS:  # the first stop counts
        signal.signal(later, signal.SIG_IGN)
    print(f"stopped by {signal.Signals(signum).name}: no file is left half-written", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def say(stopped):
    """The exit status of a run stopped at start-up; rank 0 says why (every rank of a launch gets the signal)."""
    if is_rank0():
        print(stopped, file=sys.stderr, flush=True)
    return stopped.code


def shield_worker():
    """In a process this rank forks (os.register_at_fork), its DataLoader workers: the signals that stop a run
    are the rank's to handle. Slurm sends them to every process of a step, Ctrl-C and a closed terminal to the
    process group, torchrun to each worker's group: a worker they ended would end the run unsaved ("killed by
    signal: Terminated"). The worker lets them pass with a handler that does nothing, neither ignoring (SIG_IGN)
    nor blocking them: a program the worker starts (a decoder) would inherit either, and never end by
    `terminate()`; exec gives a handled signal its default action back. torch's handler for SIGTERM, which ends
    a worker by anyone's SIGTERM, is set when the worker starts (after this): ours replaces it at once. The
    worker still ends with its rank: by the end of its queue, or when torch's watchdog finds the rank gone."""
    for signum in STOPS:
        signal.signal(signum, let_pass)
    signal.set_wakeup_fd(-1)  # its rank's pipe: this process's signals are not the rank's
    handling = sys.modules.get("torch.utils.data._utils.signal_handling")
    install = getattr(handling, "_set_worker_signal_handlers", None)
    if install is None:  # no DataLoader in this process
        return

    def then_ours():
        install()  # SIGBUS, SIGSEGV, SIGFPE: one line before the worker dies
        signal.signal(signal.SIGTERM, let_pass)

    handling._set_worker_signal_handlers = then_ours  # in this forked process only


def let_pass(signum, frame):
    """A worker's handler of the stops: its rank acts on them."""
