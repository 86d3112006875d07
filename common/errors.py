"""Guard rail: how a run ends when it is interrupted or loses a DataLoader worker. `run(main)` is the last
line of every stage: Ctrl-C, and a worker process killed under it (most often by the out-of-memory killer),
each end the run with one line that says what happened and what to do, instead of a traceback. Nothing is
lost that a checkpoint holds: the last finished epoch stays in --output-dir."""

import re
import sys

from common.environment import is_rank0


def run(main):
    try:
        main()
    except KeyboardInterrupt:
        if is_rank0():  # Ctrl-C reaches every rank of the terminal's launch: one says it
            print("error: interrupted (Ctrl-C): the checkpoint of the last finished epoch is kept in --output-dir: "
                  "continue with --resume", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(130) from None  # the shell's code for a run ended by SIGINT
    except RuntimeError as err:
        # "DataLoader worker (pid(s) 812) exited unexpectedly", caused by "... (pid 812) is killed by signal: Killed."
        lost = re.match(
            r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is )?(.*?)\.?\s*$", str(err.__cause__ or err)
        )
        if not lost:
            raise
        raise SystemExit(
            f"error: a DataLoader worker of this rank (pid {lost[1]}) ended ({lost[2]}), most likely killed by the "
            "out-of-memory killer: use fewer --num-workers, or ask for more memory (#SBATCH --mem); then continue "
            "with --resume"
        ) from None
