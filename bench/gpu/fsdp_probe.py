"""Where stage 05's step time goes at world size 1: ms per training step of the MNIST Net at batch 64, plain, DDP,
FSDP2 on stage 05's units (models.gathered: fc1) and at the root, Adadelta by foreach (as stage 05), per block and at
the root, at the root only, per block without resharding (these with Adadelta's default); the best of two
rounds of N steps (N=300); then torch.profiler's top host costs of the per-block step. Run from the project's root."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from common import models  # noqa: E402

KINDS = ("plain", "ddp", "fsdp-stage05", "fsdp-blocks", "fsdp-root", "fsdp-noreshard")


def build(kind, device):
    torch.manual_seed(0)
    model = models.build("net", 1, 10, 28).to(device)
    if kind == "ddp":
        return DDP(model)
    if kind.startswith("fsdp"):
        if kind != "fsdp-root":
            units = models.gathered(models.blocks(model)) if kind == "fsdp-stage05" else models.blocks(model)
            for block in units:
                fully_shard(block, reshard_after_forward=kind != "fsdp-noreshard")
        fully_shard(model)
    return model


def steps(model, optimizer, batch, n):
    x, y = batch
    for _ in range(n):
        optimizer.zero_grad(set_to_none=True)
        F.nll_loss(model(x), y).backward()
        optimizer.step()
    if x.is_cuda:
        torch.cuda.synchronize()


def main():
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    batch = torch.randn(64, 1, 28, 28, device=device), torch.randint(10, (64,), device=device)
    n, times = int(os.environ.get("N", "300")), {kind: [] for kind in KINDS}
    for _ in range(2):
        for kind in KINDS:
            model = build(kind, device)
            optimizer = torch.optim.Adadelta(model.parameters(), foreach=True if kind == "fsdp-stage05" else None)
            steps(model, optimizer, batch, min(20, n))  # warm-up (N=2: a check of the script)
            start = time.perf_counter()
            steps(model, optimizer, batch, n)
            times[kind].append(1e3 * (time.perf_counter() - start) / n)
    for kind, ms in times.items():
        print(f"{kind:16s} {min(ms):.3f} ms/step (runs {', '.join(f'{t:.3f}' for t in ms)})")
    model = build("fsdp-blocks", device)
    optimizer = torch.optim.Adadelta(model.parameters())
    steps(model, optimizer, batch, min(10, n))
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as p:
        steps(model, optimizer, batch, min(20, n))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
