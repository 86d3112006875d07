"""Benchmark the stages on this machine: `make benchmarks` (or python bench/bench.py), on its GPUs or its CPU.

Every configuration runs the real train.py for a fixed number of epochs and is read back from its
metrics.csv. Reported per configuration (the median over its repeats): the median epoch time of the
epochs after the first (the first pays for start-up and for --compile's compiler), images/s in total
and per device, the compile time, the training time until the test accuracy first reaches 99 % (the
first epoch included, its compile time not), and the final accuracy. Configurations that are compared
run alternately, round after round, so that drifts of a noisy machine hit all of them alike.

On GPUs: pytorch/examples' classic pipeline as the reference; 01, 02, 03 and 05 at batch 64 and 512,
eager and compiled; the device loader; the large-batch recipes for the time to 99 %; 1 -> N GPUs.
On a CPU (no GPU claims): stage 01 with the default loader, the classic one and --compile, and stage 03
at 1 and 2 gloo processes, on the first --limit images (a full MNIST epoch takes 46 s on 2 cores).

Writes OUT/bench.csv (one row per run), OUT/bench.md (the table) and, if matplotlib is installed,
OUT/bench.png (test accuracy against training time).
"""

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
STAGES = ["01_single_gpu", "02_dataparallel", "03_ddp_single_node"]
FAST = ("--loader", "device")
RECIPES = {  # large global batches, for the time to 99 %: the learning rate grows, and decays more slowly
    "b512": ("--batch-size", "512", "--lr", "2.0", "--gamma", "0.8"),
    "b1024": ("--batch-size", "1024", "--lr", "3.0", "--gamma", "0.8"),
    "b1024 g0.85": ("--batch-size", "1024", "--lr", "2.0", "--gamma", "0.85"),
}


def configs(gpus, rounds):
    """(name, stage, GPUs, flags, epochs) for every run, in the order they run."""
    if not torch.cuda.is_available():
        return cpu_configs(rounds)
    runs = [("01 classic (pytorch/examples)", "01_single_gpu", 1, ("--loader", "classic", "--num-workers", "1"), 4)]
    for _ in range(rounds):  # alternating: 01, 02 and 03 at one GPU see the same machine state
        runs += [(f"{stage[:2]} default, 1 GPU", stage, 1, (), 4) for stage in STAGES]
    for _ in range(rounds):  # eager against compiled, at the default batch and a large one
        for stage in (*STAGES, "05_fsdp"):
            for batch in ("64", "512"):
                for compiled in ((), ("--compile",)):
                    name = f"{stage[:2]} batch {batch}{' --compile' if compiled else ''}, 1 GPU"
                    runs.append((name, stage, 1, ("--batch-size", batch, *compiled), 4))
    runs.append(("01 --loader device, 1 GPU", "01_single_gpu", 1, FAST, 4))
    runs.append(("03 --loader device, 1 GPU", "03_ddp_single_node", 1, FAST, 4))
    for name, flags in RECIPES.items():
        for compiled in ((), ("--compile",)):
            runs.append(
                (
                    f"01 --loader device {name}{' --compile' if compiled else ''}",
                    "01_single_gpu",
                    1,
                    FAST + flags + compiled,
                    12,
                )
            )
    n = 2
    while n <= gpus:  # 1 -> N GPUs: one process for all (02) against one per GPU (03)
        runs += [(f"{stage[:2]} default, {n} GPUs", stage, n, (), 4) for stage in STAGES[1:]]
        runs.append((f"03 --loader device, {n} GPUs", "03_ddp_single_node", n, FAST, 4))
        n *= 2
    return runs


def cpu_configs(rounds, limit="6400"):
    """The CPU rows: the loaders and --compile on stage 01, and 1 -> 2 gloo processes on stage 03."""
    cut = ("--limit", limit)
    runs = []
    for _ in range(rounds):
        runs += [
            (
                "01 classic (pytorch/examples)",
                "01_single_gpu",
                1,
                (*cut, "--loader", "classic", "--num-workers", "1"),
                3,
            ),
            ("01 default", "01_single_gpu", 1, cut, 3),
            ("01 default --compile", "01_single_gpu", 1, (*cut, "--compile"), 3),
            ("03 default, 1 process", "03_ddp_single_node", 1, cut, 3),
            ("03 default, 2 processes", "03_ddp_single_node", 2, cut, 3),
        ]
    return runs


def run(stage, gpus, flags, epochs, output_dir, extra):
    script = str(REPO / stage / "train.py")
    launcher = [sys.executable, script]
    if stage.startswith(("03", "05")):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", script]
    args = ["--epochs", str(epochs), "--output-dir", str(output_dir), *flags, *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    if not torch.cuda.is_available():  # the CPU's cores, shared by the processes
        env.pop("CUDA_VISIBLE_DEVICES")
        env["OMP_NUM_THREADS"] = str(max(os.cpu_count() // gpus, 1))
    subprocess.run([*launcher, *args], check=True, stdout=subprocess.DEVNULL, env=env)
    return list(csv.DictReader(open(output_dir / "metrics.csv")))


def summarise(rows, gpus):
    seconds = [float(r["epoch_seconds"]) for r in rows]
    images = float(rows[-1]["images_per_s"]) * seconds[-1]  # images in one epoch
    median = statistics.median(seconds[1:])
    compiling = [float(r.get("compile_seconds") or 0) for r in rows]
    trained = [s - c for s, c in zip(seconds, compiling, strict=True)]  # the time to 99 % leaves the compiler out
    reached = [sum(trained[: i + 1]) for i, r in enumerate(rows) if float(r["test_accuracy"]) >= 99.0]
    return {
        "compile_s": sum(compiling),
        "median_epoch_s": median,
        "images_per_s": images / median,
        "images_per_s_per_gpu": images / median / gpus,
        "seconds_to_99": reached[0] if reached else float("nan"),
        "final_accuracy": float(rows[-1]["test_accuracy"]),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "bench-results")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of 01, 02 and 03 (default: 3)")
    p.add_argument("extra", nargs="*", help="more train.py flags for every run, after --, e.g. -- --data-dir DIR")
    a = p.parse_args()
    gpus = max(torch.cuda.device_count(), 1)
    results = []
    for i, (name, stage, used, flags, epochs) in enumerate(configs(gpus, a.rounds)):
        rows = run(stage, used, flags, epochs, a.out / "runs" / f"{i:02d}", a.extra)
        results.append({"name": name, "stage": stage, "gpus": used, "flags": " ".join(flags), "epochs": epochs,
                        **summarise(rows, used), "curve": rows})  # fmt: skip
        print(
            f"{name:42s} {results[-1]['median_epoch_s']:7.3f} s/epoch {results[-1]['images_per_s']:9.0f} img/s",
            flush=True,
        )
    write(results, a.out)


def write(results, out):
    fields = ["name", "stage", "gpus", "flags", "epochs", "median_epoch_s", "images_per_s", "images_per_s_per_gpu",
              "compile_s", "seconds_to_99", "final_accuracy"]  # fmt: skip
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    names = list(dict.fromkeys(r["name"] for r in results))
    reference = statistics.median(r["images_per_s"] for r in results if r["name"] == names[0])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    unit = "GPUs" if torch.cuda.is_available() else "processes"
    lines = [f"{device}, torch {torch.__version__}; medians over repeats ({len(results)} runs)", "",
             f"| configuration | {unit} | runs | s/epoch | images/s | per process | × classic | compile s | s to 99 % | accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in names:
        runs = [r for r in results if r["name"] == name]
        m = {k: statistics.median(r[k] for r in runs) for k in fields[5:]}
        to99 = f"{m['seconds_to_99']:.2f}" if m["seconds_to_99"] == m["seconds_to_99"] else "–"
        lines.append(
            f"| {name} | {runs[0]['gpus']} | {len(runs)} | {m['median_epoch_s']:.3f} | {m['images_per_s']:.0f} "
            f"| {m['images_per_s_per_gpu']:.0f} | {m['images_per_s'] / reference:.2f} | {m['compile_s']:.1f} | {to99} "
            f"| {m['final_accuracy']:.2f} |"
        )
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        rows = next(r for r in results if r["name"] == name)["curve"]
        t = [sum(float(r["epoch_seconds"]) for r in rows[: i + 1]) for i in range(len(rows))]
        ax.plot(t, [float(r["test_accuracy"]) for r in rows], marker="o", label=name)
    ax.axhline(99.0, color="grey", linestyle=":")
    ax.set(xscale="log", xlabel="training time (s)", ylabel="test accuracy (%)", ylim=(97, 99.5), title=device)
    ax.legend(fontsize=7)
    fig.savefig(out / "bench.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
