"""What makes the MNIST Net's training step fast on one GPU: ms per step (Adadelta, batch on the GPU) of
  eager; torch.compile's default mode; "reduce-overhead" for the model (what stage 01's --compile does) with the
  optimizer eager, or its step compiled too (learning rate a tensor); the whole step as one CUDA graph (forward,
  backward and a capturable optimizer, `torch.cuda.graph`), the model eager or compiled inside it;
  DDP at one rank: as stage 03, with gradient_as_bucket_view, with static_graph;
then eager against the whole-step graph at batch 256 to 2048 (the time-to-99 % recipes' batches).
Each: the best of two rounds of N steps (N=300) after warm-up, and its set-up seconds (compiling, capture).
Run from the project's root. On a CPU (a check of the script) only eager and DDP, N=5."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.getcwd())
from common import models  # noqa: E402

CUDA = torch.cuda.is_available()
N = int(os.environ.get("N", 300 if CUDA else 5))


def sync():
    if CUDA:
        torch.cuda.synchronize()


def setup(batch, device, capturable=False, tensor_lr=False):
    torch.manual_seed(0)
    model = models.build("net", 1, 10, 28).to(device)
    lr = torch.tensor(1.0, device=device) if tensor_lr else 1.0
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr, capturable=capturable)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, optimizer, x, y


def eager_step(model, optimizer, x, y, opt_step=None):
    optimizer.zero_grad(set_to_none=True)
    loss = F.nll_loss(model(x), y)
    loss.backward()
    (opt_step or optimizer.step)()
    return loss.detach()


def graphed(model, optimizer, x, y):
    """The whole step captured once, replayed: the input copied into the captured tensors."""
    static_x, static_y = x.clone(), y.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(3):
            eager_step(model, optimizer, static_x, static_y)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = F.nll_loss(model(static_x), static_y)
        loss.backward()
        optimizer.step()

    def step(model, optimizer, x, y):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return loss

    return step


def measure(name, batch, device, kind):
    t0 = time.perf_counter()
    step = eager_step
    model, optimizer, x, y = setup(
        batch, device, capturable=kind.startswith("graph"), tensor_lr=kind in ("ro+opt", "graph", "graph+compile")
    )
    if kind in ("default", "reduce-overhead", "ro+opt", "graph+compile"):
        mode = {"ro+opt": "reduce-overhead", "graph+compile": "default"}.get(kind, kind)
        model.compile(mode=mode)
    if kind == "ro+opt":
        opt_step = torch.compile(optimizer.step)
        step = lambda m, o, x, y: eager_step(m, o, x, y, opt_step)  # noqa: E731
    if kind.startswith("ddp"):
        options = {"ddp-bucket-view": dict(gradient_as_bucket_view=True), "ddp-static": dict(static_graph=True)}.get(
            kind, {}
        )
        model = DDP(model, device_ids=[device.index] if CUDA else None, **options)
    if kind.startswith("graph"):
        for _ in range(3):  # compile (graph+compile) before the capture
            eager_step(model, optimizer, x, y)
        step = graphed(model, optimizer, x, y)
    for _ in range(10):
        loss = step(model, optimizer, x, y)
    sync()
    setup_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        for _ in range(N):
            loss = step(model, optimizer, x, y)
        sync()
        best = min(best, (time.perf_counter() - t) / N)
    print(
        f"| {name} | {batch} | {best * 1e3:.3f} ms/step | {batch / best:,.0f} img/s | setup {setup_s:.1f} s "
        f"| loss {loss.item():.3f} |",
        flush=True,
    )
    return best


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if CUDA else 'CPU'}, N={N}")
    print("| kind | batch | ms/step | images/s | set-up | last loss |\n|---|---|---|---|---|---|")
    kinds = ["eager", "ddp", "ddp-bucket-view", "ddp-static"]
    if CUDA:
        kinds[1:1] = ["default", "reduce-overhead", "ro+opt", "graph", "graph+compile"]
    base = {}
    for kind in kinds:
        try:
            base[kind] = measure(kind, 64, device, kind)
        except Exception as e:  # a mode that fails here is a row too
            print(f"| {kind} | 64 | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} |", flush=True)
    if "eager" in base:
        print(
            "speed-up vs eager at batch 64: "
            + ", ".join(f"{k} {base['eager'] / v:.2f}x" for k, v in base.items() if k != "eager")
        )
    for batch in (256, 512, 1024, 2048) if CUDA else (256,):
        for kind in ("eager", "graph") if CUDA else ("eager",):
            try:
                measure(kind, batch, device, kind)
            except Exception as e:
                print(f"| {kind} | {batch} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
