"""The command line, identical in every stage: pytorch/examples' mnist flags plus what Slurm runs
need. A stage adds the options' flags (common/options/flags.py); a task its own (--task); the guard
rails check the numbers' ranges and say a usage error in one line (common/guards/check.py)."""

import argparse
import os
import re
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK = REPO / "common" / "tasks" / "images.py"  # the built-in task: pytorch/examples' MNIST CNN


def default_output_dir(script, env=os.environ):
    """runs/<stage>/<job id>.<step id>: a requeued job finds its own folder again, and two runs in
    one job (several srun steps) get their own; else torchrun's run id, or the time and the pid."""
    run = env.get("SLURM_JOB_ID")
    if run and "SLURM_ARRAY_TASK_ID" in env:
        run += "_" + env["SLURM_ARRAY_TASK_ID"]
    if run and "SLURM_STEP_ID" in env:  # not in the batch shell: a second run there is refused
        run += "." + env["SLURM_STEP_ID"]
    elif not run and env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        run = "torchrun-" + env["TORCHELASTIC_RUN_ID"]  # every rank's, and after a restart
    run = run or time.strftime("local-%Y%m%d-%H%M%S-") + str(os.getpid())
    run = re.sub(r"[^\w.-]|^\.+", "_", run)  # one folder inside runs/, whatever a variable holds
    return script.parent.parent / "runs" / script.parent.name / run


class UsageError(Exception):
    """A command line the parser refuses; the guard rails say it in one line (exit status 2)."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """Raise, not print a usage block and exit: each rank would print it."""
        raise UsageError(message)


def parser(script, groups=()):
    """Every stage's flags, then `groups`' (the options'), in full: --out is no --output-dir."""
    p = Parser(description=f"{script.parent.name}: train a task", allow_abbrev=False)
    add = p.add_argument
    here = Path.cwd().joinpath  # paths made absolute where the run starts: a task's code may chdir
    add("--task", type=here, default=TASK, help="a Python file: the model and data to train")
    add("--batch-size", type=int, default=64, help="global, split over the GPUs (default: 64)")
    add("--test-batch-size", type=int, default=1000, help="per process (default: 1000)")
    add("--epochs", type=int, default=14, help="epochs to train (default: 14)")
    add("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    add("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    add("--seed", type=int, default=1, help="random seed (default: 1)")
    add("--log-interval", type=int, default=100, help="batches a progress line (default: 100)")
    add("--dry-run", action="store_true", help="one batch per epoch: does everything run?")
    add("--limit", type=int, metavar="N", help="the first N images of each split (quick runs)")
    add("--no-cuda", action="store_true", help="train on the CPU even if a GPU is visible")
    add("--data-dir", type=here, default=REPO / "data", help="MNIST/raw/, ... (default: data/)")
    add("--output-dir", type=here, default=default_output_dir(script), help="runs/<stage>/<job>")
    add("--resume", nargs="?", const=True, type=here, metavar="PATH", help="its own, or PATH's")
    add("--dist-timeout", type=int, default=300, help="seconds a collective waits (default: 300)")
    add("--sync-bn", action="store_true", help="DDP: BatchNorm statistics over the global batch")
    for group in groups:
        group(p)
    return p


def load_task(path):
    """The task file `path` as a module: model(), datasets(), options... (common/tasks/images.py)"""
    name, source = f"task_{path.stem}", path.read_bytes()  # once: run and recorded
    task = sys.modules[name] = types.ModuleType(name)  # found by name: dataclasses, pickle
    task.__file__, task.__source__ = str(path), source  # hashed: what ran, the file gone after
    exec(compile(source, path, "exec"), vars(task))  # any path: read as Python, or an OSError
    return task


def task_path(argv=None):
    """--task's path, read first: the task adds options of its own."""
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--task", type=Path, default=TASK)
    return first.parse_known_args(argv)[0].task


def parse_args(argv=None, groups=()):
    """The flags of the stage that runs (sys.argv[0]), `groups`' and those of its task (--task):
    returns (args, the task); UsageError for a command line the parser refuses."""
    p = parser(Path(sys.argv[0]).resolve(), groups)  # before any code of the task runs
    task = load_task(path := task_path(argv))
    if hasattr(task, "add_arguments"):
        task.add_arguments(p.add_argument_group(f"the task's options ({path.name})"))
    args = p.parse_args(argv)
    if hasattr(task, "check") and (problem := task.check(args)):
        p.error(problem)
    return args, task
