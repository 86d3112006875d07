"""Steps to 99 % test accuracy for candidate recipes of stage 01's Net, over seeds: each run is stage 01's own
main() (in this process, eager, --loader device, stopping at --target 99), its guard rails left out.
Steps to an accuracy do not depend on the hardware; the time per step does (measure.sh's speedup rows, step_probe):
time to 99 % = steps x time per step. Prints a row per candidate, then `best:` the flags of the one that reached 99 %
in every seed in the least eager time (epochs x s/epoch).

python bench/gpu/recipes.py [SEEDS] [EPOCHS_CAP]    (from the project's root; QUICK=1: 640 images, to check it)
EPOCHS_CAP (10) caps every candidate's epochs, its own --epochs too.
"""

import contextlib
import csv
import importlib.util
import io
import math
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from no_guard import NoGuard  # noqa: E402

CANDIDATES = [  # the stages' own flags
    "--batch-size 1024 --lr 2.0 --gamma 0.85",  # measure.sh's RECIPE before
    "--batch-size 256 --lr 1.0 --gamma 0.7",
    "--batch-size 512 --lr 1.5 --gamma 0.7",
    "--batch-size 128 --optimizer adam --lr 0.002 --scheduler cosine --epochs 3",
    "--batch-size 256 --optimizer adam --lr 0.003 --scheduler cosine --epochs 3",
    "--batch-size 256 --optimizer adam --lr 0.003 --scheduler cosine --epochs 4",
    "--batch-size 512 --optimizer adam --lr 0.004 --scheduler cosine --epochs 4",
    "--batch-size 512 --optimizer adam --lr 0.006 --scheduler cosine --epochs 5",
]


def stage():
    spec = importlib.util.spec_from_file_location("stage01", "01_single_gpu/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(main, flags, seed, cap, folder):
    argv = [*flags.split(), "--seed", str(seed), "--loader", "device", "--target", "99"]
    own = int(flags.split("--epochs ")[1].split()[0]) if "--epochs" in flags else cap
    argv += ["--epochs", str(min(own, cap))]  # the last --epochs is the one read: a cap on every candidate
    argv += ["--limit", "640"] if os.environ.get("QUICK") else []
    sys.argv = ["train.py", *argv, "--output-dir", folder]
    with contextlib.redirect_stdout(io.StringIO()):
        main(NoGuard())
    with open(os.path.join(folder, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    reached = float(rows[-1]["test_accuracy"]) >= 99
    return (len(rows) if reached else math.inf), float(rows[-1]["test_accuracy"]), rows


def main():
    seeds = range(1, int(sys.argv[1]) + 1) if len(sys.argv) > 1 else range(1, 6)
    cap = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    train, best = stage().main, (math.inf, None)
    print("| recipe | epochs to 99 % by seed | mean steps to 99 % | s/epoch (eager, median) | final accuracy |")
    print("|---|---|---|---|---|")
    for flags in CANDIDATES:
        batch = int(flags.split("--batch-size ")[1].split()[0])
        steps_per_epoch = math.ceil((640 if os.environ.get("QUICK") else 60000) / batch)
        epochs, accuracies, seconds = [], [], []
        for seed in seeds:
            with tempfile.TemporaryDirectory() as folder:
                n, accuracy, rows = run(train, flags, seed, cap, folder)
            epochs.append(n)
            accuracies.append(accuracy)
            seconds += [float(r["epoch_seconds"]) for r in rows[1:]]
        steps = statistics.mean(epochs) * steps_per_epoch
        print(f"| {flags} | {', '.join(str(e) for e in epochs)} | {steps:.0f} | "
              f"{statistics.median(seconds) if seconds else math.nan:.3f} | "
              f"{', '.join(f'{a:.2f}' for a in accuracies)} |", flush=True)  # fmt: skip
        if seconds and math.isfinite(statistics.mean(epochs)):  # every seed reached 99 %
            best = min(best, (statistics.mean(epochs) * statistics.median(seconds), flags))
    print(f"best: {best[1]}" if best[1] else "best: none reached 99 % in every seed")


if __name__ == "__main__":
    main()
