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

try:  # the stages' train(): timed per line under kernprof -l or LINE_PROFILE=1
    from line_profiler import profile
except ImportError:  # an environment without it trains the same, untimed

    def profile(func):
        return func


FIELDS = [  # accuracy: or the task's metric; better: its direction, "higher" or "lower"
    "epoch", "lr", "train_loss", "val_loss", "val_accuracy", "test_loss", "test_accuracy",
    "epoch_seconds", "images_per_s", "images_per_s_per_process", "world_size", "nodes",
    "peak_memory_mib", "compile_seconds", "better",
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
    """Seconds since `start`, once the GPU has finished (else a timer measures kernel launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Log:
    """The rows of metrics.csv and the epoch lines, from sums all-reduced: alike on every rank; rank
    0 writes. `cut`: an epoch resumed part-way, its seconds and training sums before the stop."""

    def __init__(self, output_dir, world_size, compiled=False, metric=None):
        self.path, self.world_size = output_dir / "metrics.csv", world_size
        self.metric = metric or Metric()
        self.fields = [field.replace("accuracy", self.metric.name) for field in FIELDS]
        self.nodes = max(world_size // ranks_per_node(world_size), 1)
        self.rows, self.clock, self.cut, self.compiles = [], (0, 0.0), {"epoch": 0}, []
        if compiled:  # when torch.compile starts and ends, in turn (torch._dynamo imports in 1.5 s)
            from torch._dynamo import callback

            callback.on_compile_start(lambda *_: self.compiles.append(time.perf_counter()))
            callback.on_compile_end(lambda *_: self.compiles.append(time.perf_counter()))

    def state_dict(self):
        return {"rows": self.rows}

    def load_state_dict(self, state):
        """A resumed run rewrites the CSV from the checkpoint's rows (an epoch logged, not saved,
        counts once), and takes the time and sums of an epoch saved part-way (its cut)."""
        self.rows, self.cut = list(state["rows"]), state.get("cut") or {"epoch": 0}
        self.write()

    def so_far(self, epoch, device):
        """This rank's training Sums of `epoch` before a stop part-way: zeros, but in an epoch
        resumed part-way; resumed at another world size (stage 05), rank 0 carries them all."""
        if self.cut["epoch"] != epoch:
            return Sums.zeros(device)
        ranks, rank = self.cut["ranks"], dist.get_rank() if dist.is_initialized() else 0
        if len(ranks) != self.world_size:
            ranks = [self.cut["training"]] + [dict.fromkeys(self.cut["training"], 0.0)] * rank
        return Sums(**{k: torch.tensor(v, device=device) for k, v in ranks[rank].items()})

    def start(self, epoch):
        self.clock = (epoch, time.perf_counter())

    def before(self, epoch):
        return self.cut["seconds"] if self.cut["epoch"] == epoch else 0

    def seconds(self, device):
        """The time of the epoch in progress, its part before an interruption included."""
        epoch, start = self.clock
        return elapsed(start, device) + self.before(epoch)

    def write(self):
        if is_rank0():
            with atomic(self.path, "w") as f:
                writer = csv.DictWriter(f, self.fields)
                writer.writeheader()
                writer.writerows(self.rows)

    def epoch(self, epoch, lr, seconds, sums):
        """`sums`: the epoch's Epoch, summed over all ranks; its training from so_far() on."""
        (training, val, test), name, value = sums, self.metric.name, self.metric.value
        seen, speed, peak = training.samples, training.samples / seconds, ""
        if torch.cuda.is_initialized():  # each epoch's own peak
            peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        # the compiler's seconds in training, inside `seconds` (an evaluation compiles after it)
        end = self.clock[1] + seconds - self.before(epoch)
        spans, self.compiles = zip(self.compiles[::2], self.compiles[1::2], strict=False), []
        row = {
            "epoch": epoch, "lr": lr, "train_loss": training.loss / seen,
            "val_loss": val.loss / val.samples if val.samples else "",
            f"val_{name}": value(val.score, val.samples) if val.samples else "",
            "test_loss": test.loss / test.samples, f"test_{name}": value(test.score, test.samples),
            "epoch_seconds": seconds, "images_per_s": speed,
            "images_per_s_per_process": speed / self.world_size,
            "world_size": self.world_size, "nodes": self.nodes, "peak_memory_mib": peak,
            "compile_seconds": sum(min(b, end) - a for a, b in spans if a < end),
            "better": self.metric.better,
        }  # fmt: skip
        self.rows.append(row)
        self.write()
        tested = self.shown(row, "test")
        if name == "accuracy":  # as pytorch/examples prints it
            tested = f"accuracy {int(test.score)}/{int(test.samples)} ({tested})"
        line = [f"epoch {epoch:3d}", f"lr {lr:.4f}", f"train loss {row['train_loss']:.4f}"]
        if val.samples:
            line.append(f"val loss {row['val_loss']:.4f} ({self.shown(row, 'val')})")
        line += [f"test loss {row['test_loss']:.4f}", tested, f"{seconds:.2f} s"]
        line.append(f"{speed:.0f} img/s ({speed / self.world_size:.0f} per process)")
        line += [f"peak {peak:.0f} MiB"] if peak != "" else []
        line += [f"compile {row['compile_seconds']:.1f} s"] if row["compile_seconds"] else []
        print0(" | ".join(line))

    def shown(self, row, split):
        """The metric of `split` in a row, as the lines show it: `95.12%`, `mae 0.1234`."""
        value, name = row[f"{split}_{self.metric.name}"], self.metric.name
        return f"{value:.2f}%" if name == "accuracy" else f"{name} {value:.4f}"

    def reached(self, target, patience):
        """--target: have the last `patience` evaluations (validation, else test) all reached it?"""
        name, better = self.metric.name, self.metric.better
        split = "val" if self.rows and self.rows[-1][f"val_{name}"] != "" else "test"
        last = [row[f"{split}_{name}"] for row in self.rows[-patience:]]
        if target is None or len(last) < patience:
            return False
        if not all(v >= target if better == "higher" else v <= target for v in last):
            return False
        print0(f"stopping: the last {patience} evaluations reached --target {target:g} ({name}, "
               f"{better} is better)")  # fmt: skip
        return True

    def summary(self):
        seconds = sum(r["epoch_seconds"] for r in self.rows)
        images = sum(r["images_per_s"] * r["epoch_seconds"] for r in self.rows)
        last = self.shown(self.rows[-1], "test")
        last = f"accuracy {last}" if self.metric.name == "accuracy" else last
        print0(f"done: {len(self.rows)} epochs, {seconds:.1f} s of training, "
               f"{images / seconds:.0f} img/s, test {last} | metrics in {self.path}")  # fmt: skip
