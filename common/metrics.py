"""Per-epoch lines and the metrics CSV, in one format for every stage, from global rank 0 only."""

import csv
import time

import torch
import torch.distributed as dist

from common.distributed import print0

FIELDS = [
    "epoch", "lr", "train_loss", "test_loss", "test_accuracy",
    "epoch_seconds", "images_per_s", "images_per_s_per_process", "world_size",
]  # fmt: skip


def elapsed(start, device):
    """Seconds since `start`, once the GPU has finished: without the wait a timer measures kernel launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class Log:
    def __init__(self, output_dir, world_size):
        self.path = output_dir / "metrics.csv"
        self.world_size = world_size
        self.rows = []

    def restore(self, rows):
        """The rows of the epochs a checkpoint holds: a resumed run rewrites the CSV from them, so an
        epoch that was logged but not checkpointed before a crash is not counted twice."""
        self.rows = list(rows)
        self.write()

    def write(self):
        if not dist.is_initialized() or dist.get_rank() == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", newline="") as f:
                writer = csv.DictWriter(f, FIELDS)
                writer.writeheader()
                writer.writerows(self.rows)

    def epoch(self, epoch, lr, seconds, totals):
        """`totals`: sums over all ranks of train loss, train samples, test loss, correct, test samples."""
        train_loss, seen, test_loss, correct, tested = totals
        row = dict(
            epoch=epoch, lr=lr, train_loss=train_loss / seen, test_loss=test_loss / tested,
            test_accuracy=100 * correct / tested, epoch_seconds=seconds, images_per_s=seen / seconds,
            images_per_s_per_process=seen / seconds / self.world_size, world_size=self.world_size,
        )  # fmt: skip
        self.rows.append(row)
        print0(
            f"epoch {epoch:3d} | lr {lr:.4f} | train loss {row['train_loss']:.4f} | test loss {row['test_loss']:.4f} "
            f"| accuracy {int(correct)}/{int(tested)} ({row['test_accuracy']:.2f}%) | {seconds:.2f} s "
            f"| {row['images_per_s']:.0f} img/s ({row['images_per_s_per_process']:.0f} per process)"
        )
        self.write()

    def summary(self):
        seconds = sum(r["epoch_seconds"] for r in self.rows)
        images = sum(r["images_per_s"] * r["epoch_seconds"] for r in self.rows)
        print0(
            f"done: {len(self.rows)} epochs, {seconds:.1f} s of training, {images / seconds:.0f} img/s, "
            f"test accuracy {self.rows[-1]['test_accuracy']:.2f}% | metrics in {self.path}"
        )
