"""Guard rail: waits that cannot outlast their bound, for the waits on other ranks that may never end (watchdog.py,
preemption.py): a deadline on a block that takes no timeout of its own, a call answered within seconds or not at
all, and the end of the process from any thread."""

import os
import sys
import threading


class deadline:
    """`with deadline(seconds, then):` calls then() if the block is still running by then: for waits that take
    no timeout of their own, or ignore it (a TCP connection to a program that accepts it but never answers)."""

    def __init__(self, seconds, then):
        self.timer = threading.Timer(seconds, then)
        self.timer.daemon = True

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


def fail(message):
    """Print and end this process now, from any thread: a rank stuck in C++ cannot be stopped politely."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def within(seconds, call):
    """call()'s result; None where it raised or outlasted `seconds` (a store gone, or stopped)."""
    result = []

    def ask():
        try:
            result.append(call())
        except Exception:  # DistError, or a store not there yet (None): no answer, as a store gone gives none
            pass

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None
