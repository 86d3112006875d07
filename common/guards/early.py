"""Guard rail: a stage's first line, before it imports torch, which takes seconds and fails on an old one. Both a
torch older than the stage runs on (versions.py) and a stop during those seconds (signals.py: Ctrl-C, a scancel
just after the start) end the run in one line instead of a traceback out of an import. And those seconds are
fewer: the collector runs less often while torch and its compiler create their millions of objects, until
Guard.resume() (started()): in training, cyclic garbage holding a step's tensors is freed within a few steps."""

import gc

from common.guards import signals


def start(script):
    """Until rails.run(): a stop ends the process in the line of a stop at start-up; then the torch check, whose
    import (importlib.metadata: tens of milliseconds) comes after the handlers, not in a window without them."""
    signals.end_at_once()
    gc.set_threshold(20_000, 10, 10)  # not every 700 new objects: 10 % less start-up (BENCHMARKS.md)
    from common.guards import versions

    versions.require(script)


def started():
    """Start-up is over (the imports, the model, its optimizer): the collector at Python's default again."""
    gc.set_threshold(700, 10, 10)
