"""The command line, identical in every stage: pytorch/examples' mnist flags plus what Slurm runs
and the workshops' experiments need; stage 05 adds its own (large_models()). The guard rails check
the numbers' ranges and say a usage error in one line (common/guards/check.py)."""

import argparse
import importlib.util
import os
import re
import sys
import time
from importlib.machinery import SourceFileLoader  # any path: read as Python, or an OSError
from pathlib import Path

from common.environment import regular_file

REPO = Path(__file__).resolve().parent.parent
REFERENCE_BATCH = 64  # the global batch --lr is given for (--lr-scaling)
# the built-in task: pytorch/examples' MNIST CNN, and more
TASK = REPO / "common" / "tasks" / "images.py"


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


def learning_rate(args):
    """--lr for this run's global batch: --lr-scaling's rule (common/optim.py says why each)."""
    ratio = args.batch_size / REFERENCE_BATCH
    return args.lr * {"none": 1, "linear": ratio, "sqrt": ratio**0.5}[args.lr_scaling]


def parser(script, options=()):
    """The options of every stage, then `options`' (functions adding a group: large_models())."""
    p = Parser(description=f"image classification training, {script.parent.name}")
    add = p.add_argument
    # fmt: off
    add("--task", type=Path, default=TASK, help="a Python file: the model and data to train "
        "(default: common/tasks/images.py, MNIST)")
    add("--batch-size", type=int, default=64, help="global, split over the GPUs (default: 64)")
    add("--test-batch-size", type=int, default=1000, help="per process (default: 1000)")
    add("--epochs", type=int, default=14, help="epochs to train (default: 14)")
    add("--lr", type=float, default=1.0, help="learning rate (default: 1.0)")
    add("--gamma", type=float, default=0.7, help="learning rate step gamma (default: 0.7)")
    add("--seed", type=int, default=1, help="random seed (default: 1)")
    add("--log-interval", type=int, default=100, help="batches a progress line (default: 100)")
    add("--dry-run", action="store_true", help="one batch per epoch: does everything run?")
    add("--limit", type=int, metavar="N", help="the first N images of each split (quick runs)")
    add("--save-model", action="store_true", help="save the model to --output-dir/model.pt")
    add("--no-cuda", action="store_true", help="train on the CPU even if a GPU is visible")
    add("--data-dir", type=Path, default=REPO / "data", help="the data sets, in torchvision's "
        "layout: MNIST/raw/, ... (default: the repository's data/)")
    add("--num-workers", type=int, help="DataLoader workers per process (default: none for "
        "--loader batched; for classic, the CPUs per rank but one)")
    add("--loader", choices=["batched", "classic", "device"], default="batched", help="whole "
        "batches from decoded tensors (default), pytorch/examples' per sample, or all on the GPU")
    add("--amp", action="store_true", help="mixed precision: bf16, else fp16 with loss scaling")
    add("--compile", action="store_true", help="torch.compile: fused kernels (per block in stage "
        "05); on one GPU the step one CUDA graph")
    add("--output-dir", type=Path, default=default_output_dir(script), help="metrics, checkpoint "
        "and model (default: runs/<stage>/<Slurm job.step, torchrun id or time and pid>)")
    add("--resume", nargs="?", const=True, type=Path, metavar="PATH", help="continue from "
        "--output-dir's checkpoint or from PATH (by itself after a requeue)")
    add("--check", action="store_true", help="check the options and exit (0, or 2 with one line), "
        "before `torchrun ... train.py ARGS` takes a typo to every worker")
    add("--checkpoint-minutes", type=float, metavar="M", help="also save every M minutes (a lost "
        "node sends no signal; SIGTERM and SIGUSR1 always save)")
    add("--dist-timeout", type=int, default=300, help="seconds a collective waits (default: 300)")
    # the workshops' experiments
    add("--sync-bn", action="store_true", help="DDP: BatchNorm statistics over the global batch")
    add("--val-fraction", type=float, default=0.0, help="held out for validation (default: 0)")
    add("--optimizer", choices=["adadelta", "adam", "rmsprop", "sgd"], default="adadelta")
    add("--momentum", type=float, default=0.0, help="sgd's and rmsprop's (default: 0)")
    add("--weight-decay", type=float, default=0.0, help="(default: 0)")
    add("--scheduler", choices=["step", "cosine"], default="step", help="lr x gamma every "
        "--step-size epochs, or a cosine down to 0 over --epochs")
    add("--step-size", type=int, default=1, help="epochs per step of --scheduler step")
    add("--lr-scaling", choices=["none", "linear", "sqrt"], default="none", help=f"--lr is for a "
        f"global batch of {REFERENCE_BATCH}: scale it with --batch-size (common/optim.py)")
    add("--target", type=float, help="stop once the last --patience evaluations reach this value "
        "of the task's metric (accuracy: in %%, at least)")
    add("--patience", type=int, default=1, help="see --target (default: 1)")
    # fmt: on
    for group in options:
        group(p)
    return p


def large_models(p):
    """Stage 05's options: the memory savers and the mesh."""
    # fmt: off
    add = p.add_argument_group("large models").add_argument
    add("--grad-accum", type=int, default=1, metavar="N", help="each rank's batch in N "
        "micro-batches, gradients reduced once after the last (default: 1)")
    add("--full-shard", action="store_true", help="shard across all ranks (FSDP), not within "
        "each node with a copy per node (HSDP, the default on several nodes)")
    add("--checkpoint-activations", action="store_true", help="keep each block's input alone and "
        "recompute the rest in the backward: less memory, a forward more of time")
    # fmt: on


def load_task(path):
    """The task file `path` as a module: model(), datasets(), options... (common/tasks/images.py)"""
    name = f"task_{path.stem}"
    spec = importlib.util.spec_from_loader(name, SourceFileLoader(name, str(regular_file(path))))
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    return task


def parse_args(argv=None, options=()):
    """The options of the stage that runs (sys.argv[0]), its own `options` and those of its task
    (--task): returns (args, the task); UsageError for a command line the parser refuses."""
    first = argparse.ArgumentParser(add_help=False)  # --task first: the task adds options
    first.add_argument("--task", type=Path, default=TASK)
    path = first.parse_known_args(argv)[0].task
    task = load_task(path)
    p = parser(Path(sys.argv[0]).resolve(), options)
    if hasattr(task, "add_arguments"):
        task.add_arguments(p.add_argument_group(f"the task's options ({path.name})"))
    args = p.parse_args(argv)
    if hasattr(task, "check") and (problem := task.check(args)):
        p.error(problem)
    return args, task
