"""What DDP costs one process, and what each of its options buys: stage 01's Net at batch 64, a training
step without DDP against DDP at world size 1 (NCCL on a GPU, gloo on the CPU), as it is and with one option
each: gradient_as_bucket_view, static_graph, both, broadcast_buffers=False, and torch.compile. Then the top
host-side costs of one DDP step from torch.profiler. Run by `make bench`, or:

    python bench/ddp_profile.py
    python bench/ddp_profile.py --eager --steps 5   # no torch.compile (minutes on a CPU): the smallest run
"""

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import models

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OPTIONS = {  # name: (DDP keyword arguments, compile)
    "no DDP (stage 01)": (None, False),
    "DDP as stage 03 builds it": ({}, False),
    "gradient_as_bucket_view=True": ({"gradient_as_bucket_view": True}, False),
    "static_graph=True": ({"static_graph": True}, False),
    "both": ({"gradient_as_bucket_view": True, "static_graph": True}, False),
    "broadcast_buffers=False": ({"broadcast_buffers": False}, False),
    "torch.compile (DDP, then compile)": ({}, True),
}


def build(ddp_options, compiled):
    torch.manual_seed(0)
    model = models.build("net", 1, 10, 28, 16, 4).to(device)
    if ddp_options is not None:
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None, **ddp_options)
    if compiled:
        model.compile()
    return model, torch.optim.Adadelta(model.parameters())


def step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    F.nll_loss(model(x), y).backward()
    optimizer.step()


def ms_per_step(model, optimizer, x, y, n=50):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step(model, optimizer, x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eager", action="store_true", help="leave torch.compile out (minutes on a CPU)")
    p.add_argument("--steps", type=int, default=50, help="steps per round, 5 rounds (default: 50)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:  # a process group of one, as torchrun --nproc_per_node=1 makes
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{folder}/pg",
                                rank=0, world_size=1)  # fmt: skip
        x = torch.randn(64, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (64,), device=device)
        built = {
            name: build(ddp, compiled) for name, (ddp, compiled) in OPTIONS.items() if not (compiled and args.eager)
        }
        for model, optimizer in built.values():
            ms_per_step(model, optimizer, x, y, n=min(10, args.steps))  # warm-up, and the compiler's time
        times = {name: [] for name in built}
        for _ in range(5):  # alternated, so that drifts of the machine hit every option alike
            for name, (model, optimizer) in built.items():
                times[name].append(ms_per_step(model, optimizer, x, y, args.steps))
        base = statistics.median(times["no DDP (stage 01)"])
        print(f"{device.type}, torch {torch.__version__}, batch 64, median of 5 x {args.steps} steps")
        print("| step | ms | × no DDP |\n|---|---|---|")
        for name, runs in times.items():
            print(f"| {name} | {statistics.median(runs):.3f} | {statistics.median(runs) / base:.2f} |")
        model, optimizer = built["DDP as stage 03 builds it"]
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(min(20, args.steps)):
                step(model, optimizer, x, y)
        print(f"\nthe host's top costs of {min(20, args.steps)} DDP steps (self CPU time):")
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=45))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
