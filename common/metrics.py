"""Per-epoch lines and the metrics CSV, in one format for every stage, from global rank 0 only; an
epoch's sums by name; the progress line; the line profiler's decorator."""

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from common.checkpoint import atomic
from common.distributed import print0
from common.environment import is_rank0, ranks_per_node

try:
    from line_profiler import profile  # the stages' train(): timed per line under kernprof -l or LINE_PROFILE=1
except ImportError:  # an environment without it trains the same, untimed

    def profile(func):
        return func


FIELDS = [
    # or the task's metric
    "epoch", "lr", "train_loss", "val_loss", "val_accuracy", "test_loss", "test_accuracy",
    "epoch_seconds", "images_per_s", "images_per_s_per_process", "world_size", "nodes", "peak_memory_mib",
    "compile_seconds", "better",  # better: "higher" or "lower", the metric's direction, for tools/
]  # fmt: skip


def accuracy(output, target):
    """Correct answers in a batch: the largest output's class, or for a single logit, 1 above 0."""
    if output.ndim == 1 or output.shape[1] == 1:
        return ((output.reshape(-1) > 0).long() == target.reshape(-1).long()).sum()
    return (output.argmax(dim=1) == target).sum()


class Metric(NamedTuple):
    """How good a model is: the task's `metric = ("mae", "lower")` and `score(output, target)`
    summed over a batch, else accuracy (in %). An evaluation logs score's mean over its samples."""

    name: str = "accuracy"
    better: str = "higher"  # or "lower": the direction --target is reached in
    score: Callable = accuracy

    @classmethod
    def of(cls, task):
        return cls(*task.metric, task.score) if hasattr(task, "metric") else cls()

    def value(self, total, samples):
        return (100 if self.name == "accuracy" else 1) * total / samples


@dataclass
class Sums:
    """A rank's batch sums: mean loss x samples, score (evaluations), samples; no sync a step."""

    loss: torch.Tensor | float
    score: torch.Tensor | float
    samples: torch.Tensor | float

    @classmethod
    def zeros(cls, device):
        return cls(*torch.zeros(3, device=device))

    def tensor(self):
        return torch.stack([self.loss, self.score, self.samples])  # Sums(*values) reads it back


class Epoch(NamedTuple):
    """An epoch's Sums, a row each (validation's zeros without --val-fraction): one all-reduce."""

    training: Sums
    validation: Sums
    test: Sums

    def tensor(self):
        return torch.stack([sums.tensor() for sums in self])

    @classmethod
    def read(cls, tensor):
        return cls(*(Sums(*row) for row in tensor.tolist()))


def progress(epoch, batch, batches, loss):
    """Print a progress line (every --log-interval batches: reading the loss waits for the GPU)."""
    print0(f"  epoch {epoch} batch {batch}/{batches} loss {loss.item():.4f}")


def elapsed(start, device):
    """Seconds since `start`, once the GPU has finished: without the wait a timer measures kernel launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Log:
    """The rows of metrics.csv (all-reduced: alike on every rank; rank 0 writes) and epoch lines."""

    def __init__(self, output_dir, world_size, compiled=False, metric=None):
        self.path, self.world_size, self.metric = output_dir / "metrics.csv", world_size, metric or Metric()
        self.fields = [field.replace("accuracy", self.metric.name) for field in FIELDS]
        self.nodes = max(world_size // ranks_per_node(world_size), 1)
        self.rows, self.clock = [], (0, 0.0)  # (epoch, start) of the epoch in progress
        self.cut = {"epoch": 0}  # an epoch resumed part-way: its seconds and training sums before
        self.compiled = 0.0  # --compile: the seconds torch.compile spent, from its own callbacks, apart in the CSV
        if compiled:  # torch._dynamo takes a second and a half to import: only where it compiles anyway
            from torch._dynamo import callback

            callback.on_compile_start(lambda *_: setattr(self, "compile_start", time.perf_counter()))
            callback.on_compile_end(lambda *_: setattr(self, "compiled", self.compiled + time.perf_counter() - self.compile_start))  # fmt: skip

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        """A resumed run rewrites the CSV from the checkpoint's rows: an epoch logged but not saved counts once.
        One saved part-way through an epoch holds that part's time and each rank's training sums (its cut)."""
        self.rows, self.cut = list(state["rows"]), state.get("cut") or {"epoch": 0}
        self.write()

    def so_far(self, epoch, device):
        """This rank's training Sums of `epoch` before a stop part-way: zeros, but in an epoch resumed
        part-way; resumed at another world size (stage 05), rank 0 carries them all."""
        if self.cut["epoch"] != epoch:
            return Sums.zeros(device)
        ranks, rank = self.cut["ranks"], dist.get_rank() if dist.is_initialized() else 0
        if len(ranks) != self.world_size:
            ranks = [self.cut["training"]] + [dict.fromkeys(self.cut["training"], 0.0)] * rank
        return Sums(**{name: torch.tensor(value, device=device) for name, value in ranks[rank].items()})

    def start(self, epoch):
        self.clock = (epoch, time.perf_counter())

    def seconds(self, device):
        """The time of the epoch in progress, its part before an interruption included."""
        epoch, start = self.clock
        return elapsed(start, device) + (self.cut["seconds"] if self.cut["epoch"] == epoch else 0.0)

    def write(self):
        if is_rank0():
            with atomic(self.path, "w") as f:
                writer = csv.DictWriter(f, self.fields)
                writer.writeheader()
                writer.writerows(self.rows)

    def epoch(self, epoch, lr, seconds, sums):
        """`sums`: the epoch's Epoch, summed over all ranks."""
        training, val, test = sums.training, sums.validation, sums.test  # training: from so_far()
        name, value, seen, shown = self.metric.name, self.metric.value, training.samples, self.shown
        row = {
            "epoch": epoch, "lr": lr, "train_loss": training.loss / seen,
            "val_loss": val.loss / val.samples if val.samples else "",
            f"val_{name}": value(val.score, val.samples) if val.samples else "",
            "test_loss": test.loss / test.samples, f"test_{name}": value(test.score, test.samples),
            "epoch_seconds": seconds, "images_per_s": seen / seconds,
            "images_per_s_per_process": seen / seconds / self.world_size,
            "world_size": self.world_size, "nodes": self.nodes,
            "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else "",
            "compile_seconds": self.compiled,  # inside epoch_seconds: the first steps of each shape wait for it
            "better": self.metric.better,
        }  # fmt: skip
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()  # each epoch's own peak
        self.rows.append(row)
        self.compiled = 0.0
        print0(
            f"epoch {epoch:3d} | lr {lr:.4f} | train loss {row['train_loss']:.4f} "
            + (f"| val loss {row['val_loss']:.4f} ({shown(row, 'val')}) " if val.samples else "")
            + f"| test loss {row['test_loss']:.4f} "
            f"| {shown(row, 'test', test.score, test.samples)} | {seconds:.2f} s "
            f"| {row['images_per_s']:.0f} img/s ({row['images_per_s_per_process']:.0f} per process)"
            + (f" | peak {row['peak_memory_mib']:.0f} MiB" if row["peak_memory_mib"] != "" else "")
            + (f" | compile {row['compile_seconds']:.1f} s" if row["compile_seconds"] else "")
        )
        self.write()

    def shown(self, row, split, total=None, samples=None):
        """The metric as the epoch line shows it: `accuracy 9512/10000 (95.12%)`, `95.12%`, `mae 0.1234`."""
        value = row[f"{split}_{self.metric.name}"]
        if self.metric.name != "accuracy":
            return f"{self.metric.name} {value:.4f}"
        return f"{value:.2f}%" if total is None else f"accuracy {int(total)}/{int(samples)} ({value:.2f}%)"

    def reached(self, target, patience):
        """--target: have the last `patience` evaluations (validation, else test) all reached it?"""
        name, higher = self.metric.name, self.metric.better == "higher"
        last = [r[f"test_{name}"] if r[f"val_{name}"] == "" else r[f"val_{name}"] for r in self.rows[-patience:]]
        if target is None or len(last) < patience:
            return False
        if not all(v >= target if higher else v <= target for v in last):
            return False
        print0(f"stopping: the last {patience} evaluations reached --target {target:g} ({name}, {self.metric.better} "
               "is better)")  # fmt: skip
        return True

    def summary(self):
        seconds, images = sum(r["epoch_seconds"] for r in self.rows), sum(r["images_per_s"] * r["epoch_seconds"] for r in self.rows)  # fmt: skip
        last = self.shown(self.rows[-1], "test")
        print0(f"done: {len(self.rows)} epochs, {seconds:.1f} s of training, {images / seconds:.0f} img/s, "
               f"test {last if self.metric.name != 'accuracy' else 'accuracy ' + last} | metrics in {self.path}")  # fmt: skip
