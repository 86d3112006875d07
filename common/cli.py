"""The command line, identical in every stage: pytorch/examples' mnist flags plus what Slurm runs and
the workshops' experiments need."""

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATASETS = ["mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic"]
REFERENCE_BATCH = 64  # the global batch --lr is given for (--lr-scaling)
TESTED = {"net": DATASETS[:2], "cnn": DATASETS, "wideresnet": DATASETS[2:]}  # the pairs the tests train


def default_output_dir(script, env=os.environ):
    """runs/<stage>/<job id>: a requeued job finds its own folder again; outside Slurm, a timestamp."""
    run = env.get("SLURM_JOB_ID")
    if run and "SLURM_ARRAY_TASK_ID" in env:
        run += "_" + env["SLURM_ARRAY_TASK_ID"]
    elif not run and env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        run = "torchrun-" + env["TORCHELASTIC_RUN_ID"]  # the same for every rank, and after a restart
    run = run or time.strftime("local-%Y%m%d-%H%M%S")
    return script.parent.parent / "runs" / script.parent.name / run


def positive(kind):
    def check(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return check


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {text}")
    return value


def fraction(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def parse_args(argv=None):
    script = Path(sys.argv[0]).resolve()
    p = argparse.ArgumentParser(description=f"image classification training, {script.parent.name}")
    # fmt: off
    p.add_argument("--batch-size", type=positive(int), default=64, help="global batch size, split across all GPUs (default: 64)")
    p.add_argument("--test-batch-size", type=positive(int), default=1000, help="evaluation batch size per process (default: 1000)")
    p.add_argument("--epochs", type=positive(int), default=14, help="number of epochs to train (default: 14)")
    p.add_argument("--lr", type=positive(float), default=1.0, help="learning rate (default: 1.0)")
    p.add_argument("--gamma", type=positive(float), default=0.7, help="learning rate step gamma (default: 0.7)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    p.add_argument("--log-interval", type=positive(int), default=100, help="batches between progress lines (default: 100)")
    p.add_argument("--dry-run", action="store_true", help="one batch per epoch, to check that everything runs")
    p.add_argument("--save-model", action="store_true", help="save the trained model to --output-dir/model.pt")
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even if a GPU is visible")
    p.add_argument("--data-dir", type=Path, default=REPO / "data", help="the data sets, in torchvision's layout: MNIST/raw/, cifar-10-batches-py/, ... (default: the repository's data/)")
    p.add_argument("--num-workers", type=non_negative_int,
                   help="DataLoader workers per process (default: none for --loader batched, where they measurably slow it down; for classic, the task's CPUs per rank minus one)")
    p.add_argument("--loader", choices=["batched", "classic", "device"], default="batched",
                   help="input pipeline: whole batches from decoded tensors (default), pytorch/examples' per-sample one, or the data set held on the GPU")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 autocast where supported, else fp16 with loss scaling")
    p.add_argument("--output-dir", type=Path, default=default_output_dir(script),
                   help="metrics, checkpoint and model (default: runs/<stage>/<job id or local-time>)")
    p.add_argument("--resume", nargs="?", const=True, type=Path, metavar="PATH",
                   help="continue from --output-dir's checkpoint, or from PATH (automatic after a Slurm requeue)")
    p.add_argument("--dist-timeout", type=positive(int), default=300,
                   help="seconds a collective may wait for the other ranks (default: 300)")
    experiments = p.add_argument_group("experiments")
    experiments.add_argument("--dataset", choices=DATASETS, default="mnist", help="in torchvision's layout under --data-dir; `make data DATASET=...` (default: mnist)")
    experiments.add_argument("--model", choices=list(TESTED), default="net", help="net: pytorch/examples' CNN for 28x28; cnn: a small CNN for any size; wideresnet: for 32x32 (default: net)")
    experiments.add_argument("--depth", type=positive(int), default=16, help="WideResNet depth, 6n+4 (default: 16)")
    experiments.add_argument("--width", type=positive(int), default=4, help="WideResNet width factor (default: 4)")
    experiments.add_argument("--sync-bn", action="store_true", help="DDP stages: BatchNorm statistics over the global batch, not each rank's share")
    experiments.add_argument("--val-fraction", type=fraction, default=0.0, help="hold out this share of the training set for validation, seeded by --seed (default: 0)")
    experiments.add_argument("--optimizer", choices=["adadelta", "adam", "rmsprop", "sgd"], default="adadelta", help="(default: adadelta, as pytorch/examples)")
    experiments.add_argument("--momentum", type=float, default=0.0, help="for sgd and rmsprop (default: 0)")
    experiments.add_argument("--weight-decay", type=float, default=0.0, help="(default: 0)")
    experiments.add_argument("--scheduler", choices=["step", "exponential", "cosine"], default="step",
                             help="step: lr x gamma every --step-size epochs; exponential: x gamma every epoch; cosine: down to 0 over --epochs (default: step)")
    experiments.add_argument("--step-size", type=positive(int), default=1, help="epochs between steps of --scheduler step (default: 1, as pytorch/examples)")
    experiments.add_argument("--lr-scaling", choices=["none", "linear", "sqrt"], default="none",
                             help=f"--lr is for a global batch of {REFERENCE_BATCH}: scale it with --batch-size linearly, by the square root, or not (default: none)")
    experiments.add_argument("--target-accuracy", type=float, help="stop once the last --patience evaluations (validation if any, else test) all reach this accuracy, in %%")
    experiments.add_argument("--patience", type=positive(int), default=1, help="see --target-accuracy (default: 1)")
    # fmt: on
    args = p.parse_args(argv)
    if args.dataset not in TESTED[args.model]:
        p.error(f"--model {args.model} is tested with --dataset {', '.join(TESTED[args.model])}, not {args.dataset}")
    return args
