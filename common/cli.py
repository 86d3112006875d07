"""The command line, identical in every stage: pytorch/examples' mnist flags plus what Slurm runs
and the workshops' experiments need; stage 05 adds its own (large_models()). A usage error is one
line on stderr and exit status 2."""

import argparse
import importlib.util
import math
import os
import re
import sys
import time
from importlib.machinery import SourceFileLoader  # any path, a folder too: read as Python, or an OSError
from pathlib import Path

from common.environment import is_rank0, regular_file

REPO = Path(__file__).resolve().parent.parent
REFERENCE_BATCH = 64  # the global batch --lr is given for (--lr-scaling)
# the built-in task: pytorch/examples' MNIST CNN, and more
TASK = REPO / "common" / "tasks" / "images.py"


def default_output_dir(script, env=os.environ):
    """runs/<stage>/<job id>.<step id>: a requeued job finds its own folder again, and two runs in one job
    (several srun steps) get their own; else torchrun's run id, or the time and the process id."""
    run = env.get("SLURM_JOB_ID")
    if run and "SLURM_ARRAY_TASK_ID" in env:
        run += "_" + env["SLURM_ARRAY_TASK_ID"]
    if run and "SLURM_STEP_ID" in env:  # the batch shell has no step; a second run there finds the first's lock
        run += "." + env["SLURM_STEP_ID"]
    elif not run and env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        run = "torchrun-" + env["TORCHELASTIC_RUN_ID"]  # the same for every rank, and after a restart
    run = run or time.strftime("local-%Y%m%d-%H%M%S-") + str(os.getpid())
    run = re.sub(r"[^\w.-]|^\.+", "_", run)  # one folder inside runs/, whatever a variable holds ("../..")
    return script.parent.parent / "runs" / script.parent.name / run


def say(message):
    """A usage error, once: from rank 0 where a launcher gives every rank the same arguments (torchrun, srun)."""
    by_hand = "TORCHELASTIC_RUN_ID" not in os.environ and "SLURM_STEP_ID" not in os.environ
    if is_rank0() or by_hand:
        print(message, file=sys.stderr)


def number(kind, interval):
    """An argparse type: a `kind` (int or float) in `interval`, written "(0, 1]" or "[1, inf)". nan fails
    every comparison and inf lies outside every interval, so neither passes."""
    low, high = (float(end.strip("([]) ")) for end in interval.split(","))

    def check(text):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not ((low < value if interval[0] == "(" else low <= value) and (value < high if interval[-1] == ")" else value <= high)):  # fmt: skip
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'} in {interval}, got {text}")  # fmt: skip
        return value

    return check


# stage 05's own options (large_models())
LARGE = ("--grad-accum", "--checkpoint-activations", "--full-shard")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line instead of a usage block, and from one rank: a job's log shows a usage error once."""
        taught = [flag for flag in LARGE if message.startswith("unrecognized arguments") and flag in message]
        if taught:  # silently ignored, it would mislead
            message = f"{taught[0]} is taught in stage 05_fsdp, not here: run 05_fsdp/train.py"
        say(f"error: {message} (see --help)")
        self.exit(2)


POSITIVE = number(int, "[1, inf)")
# 2**32 - 1, numpy.random.seed's limit; past 2**64 torch.manual_seed crashes
SEED = number(int, "[0, 4294967295]")


def learning_rate(args):
    """--lr for this run's global batch: --lr-scaling's rule (common/optim.py says why each)."""
    ratio = args.batch_size / REFERENCE_BATCH
    return args.lr * {"none": 1, "linear": ratio, "sqrt": ratio**0.5}[args.lr_scaling]


def parser(script, options=()):
    """The options of every stage, then those of `options` (functions that add a group: large_models())."""
    p = Parser(description=f"image classification training, {script.parent.name}")
    # fmt: off
    p.add_argument("--task", type=Path, default=TASK, help="a Python file: the model and data to train, and their options (default: common/tasks/images.py, MNIST)")
    p.add_argument("--batch-size", type=POSITIVE, default=64, help="global batch size, split across all GPUs (default: 64)")
    p.add_argument("--test-batch-size", type=POSITIVE, default=1000, help="evaluation batch size per process (default: 1000)")
    p.add_argument("--epochs", type=POSITIVE, default=14, help="number of epochs to train (default: 14)")
    p.add_argument("--lr", type=number(float, "(0, 3.4e38]"), default=1.0, help="learning rate (default: 1.0)")
    p.add_argument("--gamma", type=number(float, "(0, 1]"), default=0.7, help="learning rate step gamma (default: 0.7)")
    p.add_argument("--seed", type=SEED, default=1, help="random seed (default: 1)")
    p.add_argument("--log-interval", type=POSITIVE, default=100, help="batches between progress lines (default: 100)")
    p.add_argument("--dry-run", action="store_true", help="one batch per epoch, to check that everything runs")
    p.add_argument("--limit", type=POSITIVE, metavar="N", help="train and evaluate on the first N images of each split: quick runs on CPUs, workshops, profiling")
    p.add_argument("--save-model", action="store_true", help="save the trained model to --output-dir/model.pt")
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even if a GPU is visible")
    p.add_argument("--data-dir", type=Path, default=REPO / "data", help="the data sets, in torchvision's layout: MNIST/raw/, cifar-10-batches-py/, ... (default: the repository's data/)")
    p.add_argument("--num-workers", type=number(int, "[0, inf)"), help="DataLoader workers per process, at most the CPUs per rank (default: none for --loader batched, where they measurably slow it down; for classic, the task's CPUs per rank minus one)")
    p.add_argument("--loader", choices=["batched", "classic", "device"], default="batched", help="input pipeline: whole batches from decoded tensors (default), pytorch/examples' per-sample one, or the data set held on the GPU")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 autocast where supported, else fp16 with loss scaling")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (per block in stage 05): fused kernels; the first steps of each shape wait for the compiler, whose time metrics.csv keeps apart")
    p.add_argument("--output-dir", type=Path, default=default_output_dir(script), help="metrics, checkpoint and model (default: runs/<stage>/<job id>.<step id>, torchrun-<id> or local-<time>-<pid>)")
    p.add_argument("--resume", nargs="?", const=True, type=Path, metavar="PATH", help="continue from --output-dir's checkpoint, or from the checkpoint file PATH (automatic after a Slurm requeue)")
    p.add_argument("--check", action="store_true", help="check the options and exit (0, or 2 with one line): `python train.py --check ARGS && torchrun ... train.py ARGS` keeps a typo from reaching every worker")
    p.add_argument("--checkpoint-minutes", type=number(float, "(0, inf)"), metavar="M", help="also save mid-epoch every M minutes, for what sends no signal (a node lost, SIGKILL); SIGTERM and SIGUSR1 always save (default: off)")
    # a collective that waits a day is a hang: a larger value is a typo (milliseconds?), and past
    # datetime.timedelta's range it would crash the process group's setup
    p.add_argument("--dist-timeout", type=number(int, "[1, 86400]"), default=300, help="seconds a collective may wait for the other ranks (default: 300)")
    # the workshops' experiments
    p.add_argument("--sync-bn", action="store_true", help="DDP stages: BatchNorm statistics over the global batch, not each rank's share")
    p.add_argument("--val-fraction", type=number(float, "[0, 1)"), default=0.0, help="hold out this share of the training set for validation, seeded by --seed (default: 0)")
    p.add_argument("--optimizer", choices=["adadelta", "adam", "rmsprop", "sgd"], default="adadelta", help="(default: adadelta, as pytorch/examples)")
    p.add_argument("--momentum", type=number(float, "[0, 1)"), default=0.0, help="for sgd and rmsprop (default: 0)")
    p.add_argument("--weight-decay", type=number(float, "[0, 3.4e38]"), default=0.0, help="(default: 0)")
    p.add_argument("--scheduler", choices=["step", "exponential", "cosine"], default="step", help="step: lr x gamma every --step-size epochs; exponential: x gamma every epoch; cosine: down to 0 over --epochs (default: step)")
    p.add_argument("--step-size", type=POSITIVE, default=1, help="epochs between steps of --scheduler step (default: 1, as pytorch/examples)")
    p.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none", help=f"--lr is for a global batch of {REFERENCE_BATCH}: scale it with --batch-size linearly, by the square root, or not (default: none)")
    p.add_argument("--target", type=number(float, "(-inf, inf)"), help="stop once the last --patience evaluations (validation if any, else test) all reach this value of the task's metric: at least it where higher is better (accuracy, in %%), at most where lower is (an error)")
    p.add_argument("--target-accuracy", type=number(float, "(0, 100]"), help="--target for a task whose metric is accuracy, in %%")
    p.add_argument("--patience", type=POSITIVE, default=1, help="see --target (default: 1)")
    # fmt: on
    for add in options:
        add(p)
    return p


def large_models(p):
    """Stage 05's options: the memory savers and the mesh."""
    # fmt: off
    large = p.add_argument_group("large models")
    large.add_argument("--grad-accum", type=POSITIVE, default=1, metavar="N", help="split each rank's share of --batch-size into N micro-batches, one backward each, gradients reduced once after the last (default: 1)")
    large.add_argument("--full-shard", action="store_true", help="on several nodes, shard across all ranks (FSDP) instead of within each node and replicate across nodes (HSDP, the default)")
    large.add_argument("--checkpoint-activations", action="store_true", help="keep only each block's input for the backward pass and recompute the rest: less memory, about one more forward pass of time")
    # fmt: on


def load_task(path):
    """The task file `path` as a module: its model(), datasets(), options and loss (common/tasks/images.py)."""
    spec = importlib.util.spec_from_loader(f"task_{path.stem}", SourceFileLoader(f"task_{path.stem}", str(regular_file(path))))  # fmt: skip
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    return task


def parse_args(argv=None, options=()):
    """The options of the stage that runs (sys.argv[0]), its own `options` and those of its task (--task):
    returns (args, the task). Usage errors exit 2 with one line."""
    first = argparse.ArgumentParser(add_help=False)  # --task first: the task file adds options of its own
    first.add_argument("--task", type=Path, default=TASK)
    path = first.parse_known_args(argv)[0].task
    task = load_task(path)
    p = parser(Path(sys.argv[0]).resolve(), options)
    if hasattr(task, "add_arguments"):
        task.add_arguments(p.add_argument_group(f"the task's options ({path.name})"))
    args = p.parse_args(argv)
    if hasattr(task, "check") and (problem := task.check(args)):
        p.error(problem)
    if args.target_accuracy is not None:  # --target for accuracy, which the guard rails check the task measures
        args.target = args.target_accuracy
    return args, task
