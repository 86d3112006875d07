"""Guard rail: a stage's first line, before it imports torch, which takes seconds and fails on an old one. Both a
torch older than the stage runs on (versions.py) and a stop during those seconds (signals.py: Ctrl-C, a scancel
just after the start) end the run in one line instead of a traceback out of an import. And those seconds are
fewer: the collector runs less often while torch and its compiler create their millions of objects, until
Guard.resume() (started()): in training, cyclic garbage holding a step's tensors is freed within a few steps."""

import gc
import os
import sys
import threading

from common.guards import signals


def start(script):
    """Until rails.run(): a stop ends the process in the line of a stop at start-up; then the torch check, whose
    import (importlib.metadata: tens of milliseconds) comes after the handlers, not in a window without them."""
    signals.end_at_once()
    gc.set_threshold(20_000, 10, 10)  # not every 700 new objects: 10 % less start-up (BENCHMARKS.md)
    working_folder()
    from common.guards import versions

    versions.require(script)


def started():
    """Start-up is over (the imports, the model, its optimizer): the collector at Python's default again."""
    gc.set_threshold(700, 10, 10)


def tool():
    """A tool's first line (tools/), as start() is a stage's: a stop (Ctrl-C in torch's import) ends it in one line
    with 128 + the signal's number, an error none of its checks names in one line with its place: never a
    traceback. A tool writes each file whole or not at all (checkpoint.atomic): neither leaves half of one."""
    signals.end_tool()
    sys.excepthook = one_line
    working_folder()


def working_folder():
    """A process started in a folder since deleted (a scratch purge, `rm -r` from another shell) is one line: torch's
    import there fails naming its own library ("Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so"), not the
    folder, and a relative path could not be read."""
    try:
        os.getcwd()
    except FileNotFoundError:
        sys.exit("error: the folder this process started in has been deleted: cd to one that exists and run again")


def run(main):
    """A tool's last line: main(), then the end with its status, even where a thread it started (a task's) is
    still running, which Python's teardown would wait for; an error in a thread is one line, as one in main()."""
    threading.excepthook = in_thread
    try:
        main()
        code = 0
    except SystemExit as done:
        code = done.code
    except BrokenPipeError:  # its reader went (`| head`): the rest unread, as after SIGPIPE, with no line
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit fails no more
        code = 128 + 13
    except BaseException as err:
        one_line(type(err), err, err.__traceback__)
        code = 1
    from common.guards import ending

    ending.end(code, joined=False)


def in_thread(raised):
    if not issubclass(raised.exc_type, SystemExit):
        from common.guards import described, waits

        said = described.tool_line(raised.exc_value)
        waits.fail(said.replace("error: ", f"error: in thread {raised.thread.name}: ", 1))


def one_line(kind, err, tb):
    """sys.excepthook: the one line of described.tool_line(), its traceback kept in a file it names."""
    from common.guards import described  # torch, imported by the time a tool fails: not before it has to

    print(described.tool_line(err.with_traceback(tb)), file=sys.stderr, flush=True)
