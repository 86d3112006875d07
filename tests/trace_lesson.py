"""Run a stage under a line tracer: the lines of common/ this process executed, as JSON, in OUT/rank<RANK>.json.

python tests/trace_lesson.py OUT 01_single_gpu/train.py --epochs 1 ...   (or as torchrun's script)
"""

import json
import os
import runpy
import sys
import threading
from pathlib import Path

COMMON = str(Path(__file__).resolve().parent.parent / "common") + os.sep


def trace(seen):
    """A tracer that records (file, line) of every line run in common/, in any thread of this process."""

    def local(frame, event, arg):
        if event == "line":
            seen.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(COMMON) else None

    return calls


if __name__ == "__main__":
    out, script = Path(sys.argv.pop(1)), sys.argv[1]
    sys.argv = sys.argv[1:]  # the stage's own command line, as cli.parse_args() reads it
    seen, ended = set(), os._exit

    def dump():
        sys.settrace(None)
        (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(sorted(seen)))

    def exit_after_dump(code):  # a rank of a process group ends by os._exit (common/guards/ending.py)
        dump()
        ended(code)

    os._exit = exit_after_dump
    sys.settrace(trace(seen))
    threading.settrace(trace(seen))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        dump()
