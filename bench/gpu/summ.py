"""One line from a run's metrics.csv, for results.txt: epochs, the median s/epoch and images/s over the epochs after
the first, the first epoch's seconds, compile seconds, the time to 99 % (training seconds, first epoch included,
the compiler's seconds not, until the test accuracy reached 99), the final accuracy, the peak MiB and the accuracy
of each epoch."""

import csv
import math
import statistics
import sys


def number(row, key):
    value = row.get(key)
    return float(value) if value not in (None, "") else math.nan


def summary(path):
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return "no metrics.csv"
    if not rows:
        return "empty metrics.csv"
    later = rows[1:] or rows  # the first epoch pays for start-up and the compiler
    seconds = statistics.median(number(r, "epoch_seconds") for r in later)
    images = statistics.median(number(r, "images_per_s") for r in later)
    compiled = sum(number(r, "compile_seconds") for r in rows if r.get("compile_seconds") not in (None, ""))
    elapsed, t99 = 0.0, None
    for r in rows:
        elapsed += number(r, "epoch_seconds") - float(r.get("compile_seconds") or 0)
        if t99 is None and number(r, "test_accuracy") >= 99.0:
            t99 = elapsed
    peak = max(number(r, "peak_memory_mib") for r in rows)
    reached = f"{t99:.2f}" if t99 else "-"
    return (
        f"epochs={len(rows)} s/epoch={seconds:.3f} img/s={images:.0f} first={number(rows[0], 'epoch_seconds'):.2f} "
        f"compile={compiled:.1f} t99={reached} acc={rows[-1]['test_accuracy']} "
        f"peakMiB={peak:.0f} acc_by_epoch={','.join(r['test_accuracy'] for r in rows)}"
    )


if __name__ == "__main__":
    print(summary(sys.argv[1]))
