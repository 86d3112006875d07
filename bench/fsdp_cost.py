"""What stage 05 costs per training step beyond FSDP's own: the step time of a bare loop (stage 01's Net
sharded as stage 05 shards it: fully_shard on its units and at the root; Adadelta by foreach, as stage 05 steps;
one batch over and over, no data loading or logging) against stage 05's train.py on the same model, batch and
threads, each under torchrun at world size 1, in turn, --rounds times; medians. The stage's figure is its last
epoch's training seconds (metrics.csv) over its steps. On the CPU a small batch leaves the host's work, which is
what differs, most of the step.

    python bench/fsdp_cost.py                      # CPU, gloo: batch 4, 1024 images, 3 rounds
    python bench/fsdp_cost.py --batch-size 64 --limit 6400 --cuda
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def built(device):
    """The bare loop's model and optimizer as stage 05 builds them at world size 1: fully_shard on its units
    (models.gathered: for the Net, fc1 alone) and at the root; Adadelta by foreach, as common/optim.py steps
    sharded weights. Every block sharded, or a loop over the tensors, would time another set-up than the stage's."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from common import models

    torch.manual_seed(0)
    model = models.build("net", 1, 10, 28).to(device)
    for block in models.gathered(models.blocks(model)):
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adadelta(model.parameters(), foreach=True)


def bare(args):
    """Run under torchrun: print the bare loop's milliseconds per step."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    device = torch.device("cuda" if args.cuda else "cpu")
    dist.init_process_group("nccl" if args.cuda else "gloo")
    model, opt = built(device)
    x, y = torch.randn(args.batch_size, 1, 28, 28, device=device), torch.randint(10, (args.batch_size,), device=device)

    def steps(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.nll_loss(model(x), y).backward()
            opt.step()
        if args.cuda:
            torch.cuda.synchronize()

    n = -(-args.limit // args.batch_size)
    steps(n)  # as the stage's first epoch: the measured one is the second
    wall, cpu = time.perf_counter(), time.process_time()
    steps(n)
    print(f"bare {1e3 * (time.perf_counter() - wall) / n:.3f} {1e3 * (time.process_time() - cpu) / n:.3f}")
    dist.destroy_process_group()


def in_stage(args, argv):
    """Run under torchrun: stage 05's train.py, its epochs timed in wall and in CPU seconds of this process (the
    latter less moved by other work on a busy machine); prints the last epoch's milliseconds per step."""
    import atexit
    import runpy

    sys.path.insert(0, str(REPO))
    from common import metrics

    clock, found = metrics.Log.start, []

    def start(log, epoch, device):
        found.append(time.process_time())
        return clock(log, epoch, device)

    def seconds(log, device, elapsed=metrics.Log.seconds):
        wall = elapsed(log, device)
        found[-1] = (wall, time.process_time() - found[-1])
        return wall

    metrics.Log.start, metrics.Log.seconds = start, seconds
    n = -(-args.limit // args.batch_size)
    atexit.register(lambda: print(f"stage {1e3 * found[-1][0] / n:.3f} {1e3 * found[-1][1] / n:.3f}", flush=True))
    sys.argv = [str(REPO / "05_fsdp" / "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def torchrun(*argv):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *argv]


def measure(what, args, flags, out):
    """(wall, CPU) milliseconds per step of the bare loop or of the stage's last epoch."""
    extra = ["--", "--epochs", "2", "--output-dir", out, *flags[:4], *([] if args.cuda else ["--no-cuda"])]
    cmd = torchrun(__file__, f"--{what}", *flags, *(extra if what == "stage" else []))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO / "05_fsdp")
    line = [x for x in done.stdout.splitlines() if x.startswith(what)]
    if done.returncode or not line:
        sys.exit(f"error: {what} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    return [float(v) for v in line[-1].split()[1:]]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--limit", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare:
        return bare(args)
    if args.stage:
        return in_stage(args, args.argv)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    os.environ.update(env)
    flags = ["--batch-size", str(args.batch_size), "--limit", str(args.limit), *(["--cuda"] if args.cuda else [])]
    times = {"bare": [], "stage": []}
    for _ in range(args.rounds):
        for what, runs in times.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(measure(what, args, flags, tmp))
        print("  ".join(f"{k} {v[-1][0]:.2f} ms ({v[-1][1]:.2f} CPU)" for k, v in times.items()), flush=True)
    for i, clock in enumerate(("wall", "CPU")):
        bare_ms, stage_ms = (statistics.median(r[i] for r in runs) for runs in times.values())
        print(f"median {clock} ms/step at batch {args.batch_size}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}: bare "
              f"fully_shard {bare_ms:.2f}, stage 05 {stage_ms:.2f}, stage/bare {stage_ms / bare_ms:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
