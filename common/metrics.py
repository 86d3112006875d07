"""Per-epoch lines and the metrics CSV, in one format for every stage, from global rank 0 only; an
epoch's sums by name; the progress line; the line profiler's decorator."""

import csv
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.checkpoint import atomic
from common.distributed import print0
from common.environment import is_rank0, nodes

try:  # the stages' train(): timed per line under kernprof -l or LINE_PROFILE=1
    from line_profiler import profile
except ImportError:  # an environment without it trains the same, untimed

    def profile(func):
        return func


FIELDS = [  # accuracy: or the task's metric; better: its direction, "higher" or "lower"
    *("epoch", "lr", "train_loss", "val_loss", "val_accuracy", "test_loss", "test_accuracy"),
    *("epoch_seconds", "images_per_s", "images_per_s_per_process", "world_size", "nodes"),
    *("peak_memory_mib", "compile_seconds", "better"),
]


def accuracy(output, target):
    """Right answers: each sample's share of its labels (B, ...) its top class (B, C, ...) hits, but
    -100's, cross-entropy's ignored (padding): a sample of none has no accuracy (nan)."""
    if output.ndim == 1 or output.shape[1] == 1:
        return ((output.reshape(-1) > 0).long() == target.reshape(-1).long()).sum()
    right = (output.argmax(dim=1) == target).reshape(len(target), -1).sum(1)
    return (right / (target != -100).reshape(len(target), -1).sum(1)).sum()


class Metric(NamedTuple):
    """How good a model is: accuracy in %, higher is better, by default; a task's own metric and
    score() (common/options/hooks.py). An evaluation logs score's mean over its samples."""

    name: str = "accuracy"
    better: str = "higher"  # or "lower": the direction --target is reached in
    score: Callable = accuracy  # summed over a batch (a task's totals: a row of sums)
    unit: tuple = ("samples", 1)  # the speed's: a task's throughput(args), e.g. ("tokens", 32)

    def value(self, row, samples):  # row: score's sums over an epoch, all-reduced
        return (100 if self.name == "accuracy" else 1) * row[0] / samples


@dataclass
class Sums:
    """A rank's batch sums: mean loss x samples, score (evaluations), samples; no sync a step."""

    loss: torch.Tensor | float
    score: torch.Tensor | float
    samples: torch.Tensor | float

    @classmethod
    def zeros(cls, device):
        return cls(*torch.zeros(3, device=device))

    def tensor(self, shape=()):  # score as wide as an evaluation's: a task's totals are a row
        return torch.cat([self.loss[None], self.score.expand(shape).view(-1), self.samples[None]])


class Epoch(NamedTuple):
    """An epoch's Sums, a row each (validation's zeros without --val-fraction): one all-reduce."""

    training: Sums
    validation: Sums
    test: Sums

    def tensor(self):
        return torch.stack([sums.tensor(self.test.score.shape) for sums in self])

    @classmethod
    def read(cls, tensor):  # each score a row: loss, score..., samples
        return cls(*(Sums(row[0], row[1:-1], row[-1]) for row in tensor.tolist()))


def progress(epoch, batch, batches, loss):
    """Print a progress line (every --log-interval batches: reading the loss waits for the GPU)."""
    print0(f"  epoch {epoch} batch {batch}/{batches} loss {loss.item():.4f}")


class Log:
    """metrics.csv's rows and the epoch lines, from sums all-reduced: alike on every rank; rank 0
    writes. `carried`: epoch -> (seconds, training Sums) before a stop; `compiled`: compile time."""

    def __init__(self, output_dir, world_size, metric):
        if is_rank0():  # the run's folder, where rank 0 alone writes (atomic() makes none)
            output_dir.mkdir(parents=True, exist_ok=True)
        self.path, self.world_size, self.metric = output_dir / "metrics.csv", world_size, metric
        self.fields = [field.replace("accuracy", metric.name) for field in FIELDS]
        self.rows, self.clock, self.carried, self.compiled = [], 0.0, {}, 0
        self.unit, self.per_sample = metric.unit  # the speed's, and what a sample counts in it

    def state_dict(self):
        return {"rows": self.rows}

    def start(self, epoch, device):
        """The epoch's clock and this rank's training sums, counting any part before a stop."""
        seconds, sums = self.carried.get(epoch, (0.0, None))
        self.clock = time.perf_counter() - seconds
        return sums or Sums.zeros(device)

    def seconds(self, device):
        if device.type == "cuda":  # else a timer measures kernel launches
            torch.cuda.synchronize(device)
        self.took = time.perf_counter() - self.clock  # the epoch's; in evaluate(), its training's
        return self.took

    def write(self):
        if is_rank0():
            with atomic(self.path, "w") as f:
                writer = csv.DictWriter(f, self.fields)
                writer.writeheader()
                writer.writerows(self.rows)

    def epoch(self, epoch, lr, seconds, sums):
        """A row from `sums`, the epoch's Epoch summed over all ranks, and its line."""
        training, val, test = sums
        speed, peak = training.samples / seconds, ""
        if torch.cuda.is_initialized():  # each epoch's own peak
            peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        compiling, self.compiled = self.compiled, 0  # inside `seconds`
        row = [epoch, lr, training.loss / training.samples, *self.mean(val), *self.mean(test)]
        row += [seconds, speed, speed / self.world_size, self.world_size, nodes(), peak]
        self.rows.append(dict(zip(self.fields, [*row, compiling, self.metric.better], strict=True)))
        self.write()
        self.say(self.rows[-1], f"{round(float(test.score[0]), 3):.10g}/{int(test.samples)}")

    def mean(self, sums):
        """(loss, metric) of an evaluation's sums; blank for no samples (no --val-fraction)."""
        if not sums.samples:
            return "", ""
        return sums.loss / sums.samples, self.metric.value(sums.score, sums.samples)

    def say(self, row, correct):
        """The epoch line: the losses, pytorch/examples' accuracy, the time, speed and memory."""
        line = [f"epoch {row['epoch']:3d}", f"lr {row['lr']:.4f}"]
        line.append(f"train loss {row['train_loss']:.4f}")
        if row["val_loss"] != "":
            line.append(f"val loss {row['val_loss']:.4f} ({self.shown(row, 'val')})")
        tested = self.shown(row, "test")
        if self.metric.name == "accuracy":  # as pytorch/examples prints it; pixels: shares, summed
            tested = f"accuracy {correct} ({tested})"
        speed = row["images_per_s"] * self.per_sample
        line += [f"test loss {row['test_loss']:.4f}", tested, f"{row['epoch_seconds']:.2f} s"]
        line.append(f"{speed:.0f} {self.unit}/s ({speed / self.world_size:.0f} per process)")
        line += [f"peak {row['peak_memory_mib']:.0f} MiB"] if row["peak_memory_mib"] != "" else []
        line += [f"compile {row['compile_seconds']:.1f} s"] if row["compile_seconds"] else []
        print0(" | ".join(line))

    def shown(self, row, split):
        """The metric of `split` in a row, as the lines show it: `95.12%`, `mae 0.1234`."""
        value, name = row[f"{split}_{self.metric.name}"], self.metric.name
        return f"{value:.2f}%" if name == "accuracy" else f"{name} {value:.4f}"

    def summary(self):
        seconds = sum(r["epoch_seconds"] for r in self.rows)
        counted = sum(r["images_per_s"] * r["epoch_seconds"] for r in self.rows) * self.per_sample
        last = self.shown(self.rows[-1], "test")
        last = f"accuracy {last}" if self.metric.name == "accuracy" else last
        print0(
            f"done: {len(self.rows)} epochs, {seconds:.1f} s of training, "
            f"{counted / seconds:.0f} {self.unit}/s, test {last} | metrics in {self.path}"
        )
