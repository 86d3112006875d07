"""Compare runs: train and test loss and the test metric (accuracy, or the task's own) per epoch, and time per epoch.

    python tools/plot.py RUN... [-o plot.png]        # make plot RUNS="runs/batch_size/<array job id>/*"

A RUN is a folder holding the metrics.csv that every stage writes, or that file itself; each run is one
line per panel, labelled with what tells runs apart: its stage (its manifest's, else the folder's parent, as
in runs/<stage>/<job id>), its world size (each in turn, for a run resumed at another) and its folder's name;
the legend lists them by world size, then by that label, numbers in it read as numbers (bs8 before bs16). The
last panel puts each run's median time per epoch (the median, so that the first epoch's warm-up weighs
little; a point per world size a run ran at) against its world size or, when every
run has the same world size and every folder is named <word><number> like sweeps/ names them (bs64,
cpus8), against that number.
"""

import argparse
import csv
import io
import itertools
import math
import re
import statistics
import sys
from pathlib import Path

from common.guards import early

if __name__ == "__main__":  # guard: Ctrl-C in torch's import, or an error no check here names, is one line
    early.tool()

from common.checkpoint import atomic  # noqa: E402
from common.guards import options, ownership  # noqa: E402
from common.guards.bounded import Refused, text  # noqa: E402
from common.guards.check import Parser  # noqa: E402

try:
    from matplotlib.figure import Figure  # without pyplot: no display, no global state
    from matplotlib.ticker import MaxNLocator

    FORMATS = sorted(Figure().canvas.get_supported_filetypes())  # by suffix: png, pdf, svg, ...
except ImportError:
    Figure = FORMATS = None

NAMED = re.compile(r"([A-Za-z_]+?)[-_]?(\d+)")  # bs64, cpus-8, gpus_4
LIMITS = (4 * 2**20, 64)  # bytes and columns of a metrics.csv: a run of 10^4 epochs writes 2 MiB in 14
COLUMNS = {"epoch", "world_size", "epoch_seconds", "images_per_s"}  # what the tools read, and test_<the metric>


def output(formats=None):
    """An argparse type: a file to write, in a folder that exists (a typo in it is refused, not created), and,
    given `formats`, with a suffix that names one of them; never a file a run writes (its metrics.csv, its
    checkpoint), nor one that is no regular file (a FIFO would block the write)."""

    def check(text):
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{path} is a folder: name a file in it")
        if ownership.named(path.name):  # as the stages' outputs are called: a run's file, or one it would write
            raise argparse.ArgumentTypeError(f"{path}: a run writes files of that name: name another file")
        if path.exists() and not path.is_file():
            raise argparse.ArgumentTypeError(f"{path} is not a regular file (a FIFO, a device): name a file")
        if not path.parent.is_dir():
            raise argparse.ArgumentTypeError(f"no folder {path.parent} for {path}: create it (mkdir -p {path.parent}) "
                                             "or name a file in a folder that exists")  # fmt: skip
        if formats and path.suffix[1:].lower() not in formats:
            raise argparse.ArgumentTypeError(f"{path}: matplotlib writes {', '.join(formats)}, chosen by the suffix, "
                                             f"not {path.suffix or 'a name without one'}")  # fmt: skip
        return path

    return check


def save(path, write):
    """`write(file)` into `path` whole or not at all: a temporary file beside it, switched in once complete (a link
    at `path` is replaced, never followed); one line where it fails (a full disk), the old file kept."""
    try:
        with atomic(path) as f:
            write(f)
    except OSError as err:
        sys.exit(f"error: could not write {path}: {err.strerror}: nothing was replaced")


def load(path):
    """(folder, rows) of one run, numbers as floats; an empty cell (no validation set) is None."""
    path = Path(path)
    csv_path = path / "metrics.csv" if path.is_dir() else path
    if not csv_path.is_file():
        sys.exit(f"error: no metrics in {path}: give run folders or their metrics.csv")
    rows, reader = [], None
    try:
        with io.StringIO(text(csv_path, LIMITS[0]), newline="") as f:  # read whole only within LIMITS, unparsed
            reader = csv.DictReader(f)
            if len(reader.fieldnames or []) > LIMITS[1]:
                raise Refused(f"{csv_path} has {len(reader.fieldnames)} columns, more than a run writes")
            name = metric(reader.fieldnames or [])
            missing = (COLUMNS | {f"test_{name}"}) - set(reader.fieldnames or [])
            if missing:
                sys.exit(f"error: {csv_path} is not a metrics.csv of these stages (no {', '.join(sorted(missing))} "
                         "column): give the folders the stages wrote")  # fmt: skip
            for row in reader:
                cells = sum(v is not None for k, v in row.items() if k is not None) + len(row.get(None) or [])
                if cells != len(reader.fieldnames):  # a row cut short, or two run together
                    raise ValueError(f"{cells} cells under a header of {len(reader.fieldnames)}")
                better = row.pop("better", None) or "higher"  # the metric's direction (text); older runs: higher
                if better not in ("higher", "lower"):  # it decides what reaching a target means: never guessed
                    raise ValueError(f"better is {better!r}, neither higher nor lower")
                row = checked({k: float(v) if v else None for k, v in row.items()}, name)
                if rows and row["epoch"] <= rows[-1]["epoch"]:  # two runs' rows, or one's twice: no one run's speed
                    raise ValueError(f"epoch {row['epoch']:.0f} follows epoch {rows[-1]['epoch']:.0f}, rows repeated")
                rows.append(row | {"metric": name, "better": better, "test_metric": row[f"test_{name}"],
                                   "val_metric": row.get(f"val_{name}")})  # fmt: skip
    except Refused as err:
        sys.exit(f"error: {err}: give the metrics.csv a run wrote, or leave the run out")
    except (ValueError, csv.Error) as err:  # a cell that is no number, bytes that are no text, a row cut short
        sys.exit(f"error: {csv_path}, line {max(reader.reader.line_num if reader else 0, 1)}: {err}: the file is damaged; the run's "
                 "checkpoint keeps the rows of its epochs (resume it to rewrite the file), or leave the run out")  # fmt: skip
    if not rows:
        sys.exit(f"error: {csv_path} has no finished epoch yet")
    return csv_path.parent, rows


def metric(fieldnames):
    """The name of the metric a metrics.csv holds in test_<name>: accuracy, or the task's (common/metrics.py)."""
    return next((f[5:] for f in fieldnames if f.startswith("test_") and f != "test_loss"), "accuracy")


CELLS = {  # what a stage writes in each column the tools read: its range, whether whole, and what it is
    "epoch": ("[1, 1e9]", True, "an epoch"), "world_size": ("[1, 1e7]", True, "a number of processes"),
    "nodes": ("[1, 1e7]", True, "a number of nodes"), "epoch_seconds": ("(0, inf)", False, "a duration"),
    "images_per_s": ("(0, inf)", False, "a rate"),  # the divisor of speed-ups
}  # fmt: skip


def checked(row, name):
    """`row`, if it holds what every stage writes: the columns read, each cell of CELLS in its range, a finite
    test metric; else a ValueError naming the cell."""
    if empty := sorted(k for k in COLUMNS | {f"test_{name}"} if row[k] is None):
        raise ValueError(f"no {', '.join(empty)}")
    for column, (interval, whole, what) in CELLS.items():
        value = row.get(column)
        if value is not None and (options.outside(value, interval) or whole and not value.is_integer()):
            raise ValueError(f"{column} {value:g} is not {what}")
    if not math.isfinite(row[f"test_{name}"]):
        raise ValueError(f"test_{name} {row[f'test_{name}']:g} is not a value a run logs")
    return row


def one_metric(folders, runs):
    """Nothing, if the runs all measure one metric in one direction: a plot's axis and a table's time to a target
    are of one thing; else one line naming what each run measures (a task's mae beside MNIST's accuracy)."""
    kinds = [sorted({(r["metric"], r["better"]) for r in rows}) for rows in runs]
    if len({kind for found in kinds for kind in found}) > 1:
        said = "; ".join(f"{folder}: {', '.join(f'{m}, {b} is better' for m, b in found)}"
                         for folder, found in zip(folders, kinds, strict=True))  # fmt: skip
        sys.exit(f"error: these runs measure different things ({said}): compare the runs of one metric")


def labels(folders):
    """Folder names; with their parent's name as well where two are alike (runs/<stage>/<job id>)."""
    folders = [f.resolve() for f in folders]  # a RUN of `.` has a name too
    names = [f.name for f in folders]
    return names if len(set(names)) == len(names) else [f"{f.parent.name}/{f.name}" for f in folders]


def label(folder, rows):
    """A run's curve label: its stage (its manifest's, else the folder's parent), world sizes (a run resumed at
    another: each, in turn) and folder name."""
    folder = folder.resolve()  # resolved: a RUN of `.` has names too
    stage = ((ownership.read(folder) or {}).get("record") or {}).get("stage") or folder.parent.name
    sizes = [int(n) for n, _ in itertools.groupby(r["world_size"] for r in rows)]
    return f"{stage}, {' then '.join(map(str, sizes))} process{'es' if sizes != [1] else ''}, {folder.name}"


def order(run):
    """The legend's order of a loaded (folder, rows): world size, then the label, its numbers as numbers."""
    folder, rows = run
    parts = re.split(r"(\d+)", label(folder, rows))
    return rows[0]["world_size"], [int(p) if i % 2 else p for i, p in enumerate(parts)]


def x_axis(names, runs):
    """The last panel's x values and axis label: see the module's docstring."""
    sizes = [int(rows[0]["world_size"]) for rows in runs]
    matches = [NAMED.fullmatch(name) for name in names]
    alike = len({r["world_size"] for rows in runs for r in rows}) == 1  # every epoch of every run
    if alike and all(matches) and len({m[1] for m in matches}) == 1:
        return [int(m[2]) for m in matches], f"{matches[0][1]}, from the run names"
    return sizes, "world size (processes)"


def figure(folders, runs):
    """Four panels; in each, one line (the last: one point) per run, in the same colour throughout."""
    names = [label(folder, rows) for folder, rows in zip(folders, runs, strict=True)]
    fig = Figure(figsize=(11, 8), layout="constrained")
    *panels, ax = fig.subplots(2, 2).flat
    name = runs[0][0]["metric"]
    columns = [("train_loss", "train loss"), ("test_loss", "test loss"),
               ("test_metric", f"test {name}{' (%)' if name == 'accuracy' else ''}")]  # fmt: skip
    for panel, (column, title) in zip(panels, columns, strict=True):
        for i, (name, rows) in enumerate(zip(names, runs, strict=True)):
            panel.plot([r["epoch"] for r in rows], [r[column] for r in rows], "o-", color=f"C{i % 10}", label=name)
        panel.set(title=title, xlabel="epoch")
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
    xs, xlabel = x_axis([folder.resolve().name for folder in folders], runs)
    sized = xlabel.startswith("world size")  # a run resumed at another world size: a point at each
    for i, (name, x, rows) in enumerate(zip(names, xs, runs, strict=True)):
        for n, part in itertools.groupby(rows, key=lambda r: r["world_size"]):
            at = int(n) if sized else x
            ax.plot([at], [statistics.median(r["epoch_seconds"] for r in part)], "o", color=f"C{i % 10}", label=name)
            name, xs = None, [*xs, at]  # one legend entry a run; every point's x a tick
    if min(xs) > 0 and len(set(xs)) > 1:
        ax.set_xscale("log", base=2)  # sweeps double their values
    ax.set_xticks(sorted(set(xs)), [str(x) for x in sorted(set(xs))])
    ax.minorticks_off()
    ax.set(title="time per epoch (median)", xlabel=xlabel, ylabel="s", ylim=(0, None))
    panels[0].legend(fontsize="small")
    return fig


def main(argv=None):
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (holding metrics.csv) or metrics.csv files")
    p.add_argument("-o", "--output", type=output(FORMATS), default="plot.png",
                   help="the image to write, in a folder that exists; its suffix names the format (default: plot.png)")  # fmt: skip
    args = p.parse_args(argv)
    if Figure is None:
        sys.exit("error: tools/plot.py needs matplotlib: pip install matplotlib")
    folders, runs = zip(*sorted(map(load, args.runs), key=order), strict=True)
    one_metric(folders, runs)
    fig = figure(folders, runs)
    save(args.output, lambda f: fig.savefig(f, format=args.output.suffix[1:].lower(), dpi=100))
    print(f"{args.output}: {len(runs)} runs")
    return fig  # for the tests


if __name__ == "__main__":
    early.run(main)  # guard: it ends with its status, even where a task left a thread running
