"""Per-epoch lines and the metrics CSV, in one format for every stage, from global rank 0 only; the
progress line; the memory line of stage 05; the line profiler's decorator."""

import csv
import time

import torch

from common import optim
from common.checkpoint import atomic
from common.distributed import print0
from common.environment import is_rank0, ranks_per_node

try:
    from line_profiler import profile  # the stages' train(): timed per line under kernprof -l or LINE_PROFILE=1
except ImportError:  # an environment without it trains the same, untimed

    def profile(func):
        return func


FIELDS = [
    "epoch", "lr", "train_loss", "val_loss", "val_accuracy", "test_loss", "test_accuracy",
    "epoch_seconds", "images_per_s", "images_per_s_per_process", "world_size", "nodes", "peak_memory_mib",
    "compile_seconds",
]  # fmt: skip


def progress(epoch, batch, batches, loss):
    """Print the progress line (every --log-interval batches: reading the loss waits for the GPU)."""
    print0(f"  epoch {epoch} batch {batch}/{batches} loss {loss.item():.4f}")


def memory(model, args, world_size, mesh):
    """Stage 05, at start: the mesh, and the bytes each rank holds of the weights, their gradients and the
    optimizer state: replicated (DDP: all of them on every rank), sharded (FSDP: 1/world size of each) and,
    on several nodes, hybrid (HSDP: 1/ranks per node). Activations and the one block FSDP gathers at a time
    come on top: the peak of each epoch is measured on GPUs."""
    per_rank = args.batch_size // world_size
    if args.grad_accum > per_rank:
        print0(f"warning: --grad-accum {args.grad_accum} is more than the {per_rank} images each rank computes per "
               f"step: each rank runs {per_rank} micro-batches of one image")  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    total = weights * (2 + optim.state_tensors(args))
    shards = mesh.shape[-1] if mesh is not None else 1  # the ranks that share one copy of the weights
    if mesh is not None and mesh.ndim == 2:
        print0(f"mesh: {mesh.shape[0]} nodes (replicate) x {mesh.shape[1]} ranks (shard): HSDP, the weights "
               "gathered within a node, the gradients all-reduced across nodes")  # fmt: skip
    elif mesh is not None:
        print0(f"mesh: {shards} ranks (shard): FSDP across all of them")
    peak = "in the log and metrics.csv each epoch" if torch.cuda.is_initialized() else "not measured on the CPU"
    print0(f"memory per rank: weights {weights:.1f} MiB + gradients {weights:.1f} MiB + {args.optimizer} state "
           f"{total - 2 * weights:.1f} MiB = {total:.1f} MiB under DDP, {total / world_size:.1f} MiB under FSDP "
           f"at world size {world_size}, {total / shards:.1f} MiB with this mesh | peak device memory: {peak}")  # fmt: skip


def elapsed(start, device):
    """Seconds since `start`, once the GPU has finished: without the wait a timer measures kernel launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Log:
    """The rows of metrics.csv (the same all-reduced numbers on every rank; rank 0 writes them) and the epoch
    lines."""

    def __init__(self, output_dir, world_size, compiled=False):
        self.path, self.world_size = output_dir / "metrics.csv", world_size
        self.nodes = max(world_size // ranks_per_node(world_size), 1)
        self.rows, self.clock = [], (0, 0.0)  # (epoch, start) of the epoch in progress
        self.cut = (0, [0.0, 0.0], 0.0)  # an epoch resumed part-way: its (epoch, [loss sum, samples], seconds) before
        self.compiled = 0.0  # --compile: the seconds torch.compile spent, from its own callbacks, apart in the CSV
        if compiled:  # torch._dynamo takes a second and a half to import: only where it compiles anyway
            from torch._dynamo import callback

            callback.on_compile_start(lambda *_: setattr(self, "compile_start", time.perf_counter()))
            callback.on_compile_end(lambda *_: setattr(self, "compiled", self.compiled + time.perf_counter() - self.compile_start))  # fmt: skip

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        """A resumed run rewrites the CSV from the checkpoint's rows: an epoch logged but not saved counts once."""
        self.rows = list(state["rows"])
        self.write()

    def start(self, epoch):
        self.clock = (epoch, time.perf_counter())

    def seconds(self, device):
        """The time of the epoch in progress, its part before an interruption included."""
        epoch, start = self.clock
        return elapsed(start, device) + (self.cut[2] if self.cut[0] == epoch else 0.0)

    def write(self):
        if is_rank0():
            with atomic(self.path, "w") as f:
                writer = csv.DictWriter(f, FIELDS)
                writer.writeheader()
                writer.writerows(self.rows)

    def epoch(self, epoch, lr, seconds, totals):
        """`totals`: over all ranks, train loss and samples, then loss, correct and samples of validation and test."""
        train_loss, seen, val_loss, val_correct, validated, test_loss, correct, tested = totals
        if self.cut[0] == epoch:  # the steps before an interruption count too
            train_loss, seen = train_loss + self.cut[1][0], seen + self.cut[1][1]
        row = dict(
            epoch=epoch, lr=lr, train_loss=train_loss / seen, test_loss=test_loss / tested,
            val_loss=val_loss / validated if validated else "", val_accuracy=100 * val_correct / validated if validated else "",
            test_accuracy=100 * correct / tested, epoch_seconds=seconds, images_per_s=seen / seconds,
            images_per_s_per_process=seen / seconds / self.world_size, world_size=self.world_size, nodes=self.nodes,
            peak_memory_mib=torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else "",
            compile_seconds=self.compiled,  # inside epoch_seconds: the first steps of each shape wait for it
        )  # fmt: skip
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()  # each epoch's own peak
        self.rows.append(row)
        self.compiled = 0.0
        val = f"| val loss {row['val_loss']:.4f} ({row['val_accuracy']:.2f}%) " if validated else ""
        print0(
            f"epoch {epoch:3d} | lr {lr:.4f} | train loss {row['train_loss']:.4f} {val}| test loss {row['test_loss']:.4f} "
            f"| accuracy {int(correct)}/{int(tested)} ({row['test_accuracy']:.2f}%) | {seconds:.2f} s "
            f"| {row['images_per_s']:.0f} img/s ({row['images_per_s_per_process']:.0f} per process)"
            + (f" | peak {row['peak_memory_mib']:.0f} MiB" if row["peak_memory_mib"] != "" else "")
            + (f" | compile {row['compile_seconds']:.1f} s" if row["compile_seconds"] else "")
        )
        self.write()

    def reached(self, target, patience):
        """--target-accuracy: did the last `patience` evaluations (validation, else test) reach it? Alike on every rank."""
        last = [r["test_accuracy"] if r["val_accuracy"] == "" else r["val_accuracy"] for r in self.rows[-patience:]]
        if target is None or len(last) < patience or min(last) < target:
            return False
        print0(f"stopping: the last {patience} evaluations reached --target-accuracy {target}%")
        return True

    def summary(self):
        seconds, images = sum(r["epoch_seconds"] for r in self.rows), sum(r["images_per_s"] * r["epoch_seconds"] for r in self.rows)  # fmt: skip
        print0(f"done: {len(self.rows)} epochs, {seconds:.1f} s of training, {images / seconds:.0f} img/s, "
               f"test accuracy {self.rows[-1]['test_accuracy']:.2f}% | metrics in {self.path}")  # fmt: skip
