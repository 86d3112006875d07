"""Scaling you can read off your own runs: images/s, speed-up, efficiency and time to a target per world size.

    python tools/scaling.py RUN... [--target 99] [--out scaling.md] [--plot scaling.png] [--bandwidth GBps]

RUNs as for tools/plot.py. The global batch and the model's size are read from the run's manifest
(run-manifest.json; a run of an older version: its checkpoint.pt, or stage 05's checkpoint/state.pt; one written
before the size was recorded: the size of the built-in task's model its options name); the nodes from metrics.csv (runs from before it was recorded: 1 for one
process, else "?"). A run resumed at another world size (stage 05 after a requeue onto fewer nodes) gives one
row per world size. Runs of different stages, or whose manifests record different options (beside the
batch and the learning rate, which scaling studies change), are named in a note above the table. Speed-up and
efficiency compare with the one run of the smallest world size; where several share it, they are "?" (name one).
--bandwidth adds rows on paper.
"""

import itertools
import statistics
import sys
import warnings
from pathlib import Path

from common.guards import early

if __name__ == "__main__":  # guard: Ctrl-C in torch's import, or an error no check here names, is one line
    early.tool()

import torch  # noqa: E402
from plot import FORMATS, Figure, labels, load, one_metric, output, save  # noqa: E402  (tools/plot.py)

from common import data, models  # noqa: E402
from common.guards import check, options, ownership  # noqa: E402
from common.guards.bounded import Refused, torch_file  # noqa: E402
from common.options import holdout  # noqa: E402
from common.options.flags import LARGE  # noqa: E402

NOTE = (
    "images/s: the median of the epochs after the first, which includes warm-up (a one-epoch run: that epoch)."
    " Efficiency: speed-up / (world size"
    " / smallest world size). Time to {0}: training seconds until the validation (else test) {1} reached it.\n"
)
AMBIGUOUS = (
    "Speed-up and efficiency: ?, as {} runs share the smallest world size, {:g} ({}): name one of them alone "
    "with the others to compare with it.\n"
)
PAPER = "On paper: {:,} fp32 gradients ({:.1f} MB) at {:g} GB/s, without latency or overlap with backward().\n"
HEADER = (
    "| world size | nodes | global batch | images/s | speed-up | efficiency | time to {0} | run |\n"
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :--- |"
)


def recorded(folder):
    """What the run's manifest records of the run (run-manifest.json's "record"), else what an older version's
    checkpoint (whole, or stage 05's sharded one) does, else {}: the options that define it ("flags") and,
    since it was recorded, the model's parameter count ("parameters"). A manifest this code did not write, or
    a file that is no checkpoint of these stages (damaged, or a pickle that would run code) is one line."""
    record = (ownership.read(folder) or {}).get("record")
    if isinstance(record, dict) and isinstance(record.get("flags"), dict):
        return record
    for saved in (folder / "checkpoint.pt", folder / "checkpoint" / "state.pt"):
        if saved.is_file():
            try:
                torch_file(saved)  # its headers against what it declares, before torch allocates what it declares
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch's, on pickle protocols: the line below says enough
                    state = torch.load(saved, map_location="cpu", weights_only=True)  # refuses code: runs nothing
                run = state.get("run") if isinstance(state, dict) else None  # what the guard rails keep of the run
                run = run.get("record", run) if isinstance(run, dict) else None  # with its id (an older one: alone)
                flags = run.get("flags") if isinstance(run, dict) else None
                cause = None if isinstance(flags, dict) else "no flags"
            except Refused as err:
                cause = str(err).removeprefix(f"{saved} ")
            except Exception as err:  # truncated, not torch's format, or objects other than tensors and plain values
                cause = type(err).__name__
            if cause:
                sys.exit(f"error: {saved} is not a checkpoint of these stages, or is damaged ({cause}): leave the run "
                         "out, or move the file away (the table then reads its metrics.csv alone)")  # fmt: skip
            return run
    return {}


def by_world_size(folder, rows):
    """A run's rows in parts of one world size each: a run resumed at another world size is two runs here, each
    with the rows before it (None: the run is one part), from whose start its time to a target counts."""
    parts = [list(group) for _, group in itertools.groupby(rows, key=lambda r: r["world_size"])]
    return [(folder, part, rows[: rows.index(part[0])] if len(parts) > 1 else None) for part in parts]


def differences(names, runs):
    """What the runs differ in besides their size: the stage (the folder's parent) and the recorded options."""
    known = [(name, r) for name, r in zip(names, runs, strict=True) if r["flags"]]
    keys = sorted(set().union(*(r["flags"] for _, r in known)) - {"batch_size", "lr", "lr_scaling"})
    columns = {"stage": [(name, r["stage"]) for name, r in zip(names, runs, strict=True)]}
    columns |= {
        f"--{k.replace('_', '-')}": [(name, r["flags"].get(k, LARGE.get(k))) for name, r in known] for k in keys
    }
    notes = [
        f"{what}: " + ", ".join(f"{value} ({name})" for name, value in pairs)
        for what, pairs in columns.items()
        if len({str(value) for _, value in pairs}) > 1
    ]
    return [f"Note: these runs differ in {'; '.join(notes)}.\n"] if notes else []


def part(folder, rows, loaded):
    """A part's name: its world size, and its epochs where its run has another part at that size (2, 1, then 2)."""
    size = rows[0]["world_size"]
    twice = sum(f == folder and other[0]["world_size"] == size for f, other, _ in loaded) > 1
    return f" (world size {size:g}" + (f", epochs {rows[0]['epoch']:g}-{rows[-1]['epoch']:g})" if twice else ")")


def measure(folder, rows, target, before=()):
    """One run: world size, nodes, global batch, images/s, the training seconds from the run's start (`before`:
    its rows at another world size, resumed here) to `target` % (None: not reached; reached in `before`: where),
    flags, parameters (None: not recorded)."""
    run = recorded(folder)
    flags = options.used(run.get("flags", {}))  # no value its recipe never read (older runs recorded them)
    seconds = itertools.accumulate(r["epoch_seconds"] for r in [*before, *rows])
    values = [r["test_metric"] if r.get("val_metric") is None else r["val_metric"] for r in [*before, *rows]]
    higher = rows[0]["better"] == "higher"
    reached = next((i for i, v in enumerate(values) if (v >= target if higher else v <= target)), None)
    world, first = int(rows[0]["world_size"]), rows[0]
    return dict(
        world=world, nodes=first.get("nodes") or (1 if world == 1 else None), flags=flags, stage=run.get("stage") or folder.resolve().parent.name,
        parameters=run.get("parameters"),
        batch=first.get("global_batch") or flags.get("batch_size"),
        rate=statistics.median(r["images_per_s"] for r in rows[1:] or rows),  # a one-epoch run: that epoch
        to_target=None if reached is None else list(seconds)[reached] if reached >= len(before) else
        f"at world size {before[reached]['world_size']:g}",  # in an earlier part
        began=before[0]["world_size"] if before else None,
    )  # fmt: skip


def parameters(run, given):
    """Values each step all-reduces: --params, else the parameters the run's manifest records, else (one
    written before they were) those of the built-in task's model its options name."""
    flags = run["flags"]
    if count := given or run["parameters"]:
        return count
    if "model" not in flags or "dataset" not in flags:
        sys.exit("error: --bandwidth needs --params: no run-manifest.json records the model's size")
    spec, shape = data.SETS[flags["dataset"]], (flags.get("depth", 16), flags.get("width", 4))
    size = 28 if len(spec.mean) == 1 else 32  # the 1-channel sets are 28x28, the others 32x32: what build() checks
    try:
        model = models.build(flags["model"], len(spec.mean), spec.classes, size, *shape)
    except ValueError as err:  # a task of its own with a --model that common/models.py does not know
        sys.exit(f"error: {err}")
    return sum(p.numel() for p in model.parameters())


def row(base, run, rate, to_target, name):
    """A table row; speed-up and efficiency against `base`, the run of the smallest world size (None: "?")."""
    n = run["world"]
    known = ["?" if v is None else f"{v:g}" for v in (run["nodes"], run["batch"])]
    name = name.replace("|", "\\|")  # a folder's name may hold the table's separator
    speedup = [f"{rate / base['rate']:.2f}", f"{rate / base['rate'] * base['world'] / n:.2f}"] if base else ["?"] * 2
    cells = [n, *known, f"{rate:.0f}", *speedup, to_target, name]
    return f"| {' | '.join(map(str, cells))} |"


def baseline(runs):
    """The run of the smallest world size, which speed-up and efficiency compare with; None where several share it:
    whichever was named first was the baseline (a sweep's bs128 beside its bs32, a part of a resumed run), and each
    other run of that size had a speed-up of its own at its own size (7.47, "efficiency 7.47")."""
    return runs[0] if sum(r["world"] == runs[0]["world"] for r in runs) == 1 else None


def report(names, runs, args):
    """The Markdown text, and the (world size, images/s) points on paper."""
    goal = f"{args.target:g}%" if args.metric == "accuracy" else f"{args.metric} {args.target:g}"
    base, paper, lines = baseline(runs), [], [NOTE.format(goal, args.metric), *differences(names, runs)]
    if base is None:
        alike = [name for name, r in zip(names, runs, strict=True) if r["world"] == runs[0]["world"]]
        lines.append(AMBIGUOUS.format(len(alike), runs[0]["world"], ", ".join(alike)))
    if args.bandwidth is not None:
        params = parameters(runs[0], args.params)
        lines.append(PAPER.format(params, 4 * params / 1e6, args.bandwidth))
    lines.append(HEADER.format(goal))
    for name, r in zip(names, runs, strict=True):
        to_target = "not reached" if r["to_target"] is None else r["to_target"]
        if isinstance(to_target, float):  # a part of a run resumed at another world size: the run's seconds
            to_target = f"{to_target:.1f} s" + (f" (from {r['began']:g})" if r["began"] is not None else "")
        lines.append(row(base, r, r["rate"], to_target, name))
        if args.bandwidth is not None and r["batch"] and base:
            compute = base["world"] / base["rate"] * r["batch"] / r["world"]  # its batch share, the smallest run's pace
            comm = 2 * (r["world"] - 1) / r["world"] * 4 * params / (args.bandwidth * 1e9)  # ring: 2(N-1)/N per rank
            paper.append((r["world"], r["batch"] / (compute + comm)))
            how = f"on paper: {1e3 * compute:.2f} ms compute + {1e3 * comm:.2f} ms all-reduce"
            lines.append(row(base, r, paper[-1][1], "", how))
    return "\n".join(lines) + "\n", paper


def figure(runs, paper):
    """images/s against world size: measured, ideal (the smallest run's rate per process times N), on paper."""
    ax = Figure(figsize=(6, 4.5), layout="constrained").subplots()
    sizes = [r["world"] for r in runs]
    if baseline(runs):  # one run at the smallest size: the ideal's base
        ax.plot(sizes, [runs[0]["rate"] / runs[0]["world"] * n for n in sizes], "--", color="grey", label="ideal")
    ax.plot(sizes, [r["rate"] for r in runs], "o-", color="C0", label="measured")
    if paper:
        ax.plot(*zip(*paper, strict=True), "s:", color="C1", label="on paper")
    ax.set_xscale("log", base=2)  # world sizes double
    ax.set_xticks(sorted(set(sizes)), [str(n) for n in sorted(set(sizes))])
    ax.minorticks_off()
    ax.set(title="images/s (median epoch after the first)", xlabel="world size (processes)", ylim=(0, None))
    ax.legend(fontsize="small")
    return ax.figure


def main(argv=None):
    p = check.Parser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (holding metrics.csv) or metrics.csv files")
    p.add_argument(
        "--target",
        "--target-accuracy",
        type=options.number(float, "(-inf, inf)"),
        help="the metric's value for the time-to column, reached at or above it where higher is better, at or below where lower is (default: 99, for accuracy in %%)",
    )
    p.add_argument("--out", type=output(), help="also write the Markdown to this file, in a folder that exists")
    p.add_argument("--plot", type=output(FORMATS),
                   help="draw images/s against world size into this image, in a folder that exists; its suffix names the format (needs matplotlib)")  # fmt: skip
    p.add_argument("--bandwidth", type=options.number(float, "(0, inf)"), metavar="GBps",
                   help="GB/s of the all-reduce links: adds the rows on paper")  # fmt: skip
    p.add_argument("--params", type=options.number(int, "[1, inf)"),
                   help="the model's parameters (default: as the run's manifest records them)")  # fmt: skip
    args = p.parse_args(argv)
    if args.out and args.plot and args.out.resolve() == args.plot.resolve():
        p.error(f"--out and --plot both name {args.out}: one would replace the other")
    files = [(path / "metrics.csv" if path.is_dir() else path).resolve() for path in args.runs]
    if twice := next((f for f in files if files.count(f) > 1), None):  # a folder and its file: one run, two rows
        p.error(f"{twice} is named twice (a run's folder and its metrics.csv are one run): name each run once")
    if args.plot and Figure is None:
        sys.exit("error: --plot needs matplotlib: pip install matplotlib")
    parts = [part for path in args.runs for part in by_world_size(*load(path))]
    # as numbers (2 before 16), then by folder and epoch: the order they are named in changes nothing
    loaded = sorted(parts, key=lambda run: (run[1][0]["world_size"], str(run[0]), run[1][0]["epoch"]))
    one_metric(*zip(*[(folder, rows) for folder, rows, _ in loaded], strict=True))
    args.metric = loaded[0][1][0]["metric"]
    if args.target is None and args.metric != "accuracy":
        sys.exit(f"error: these runs measure {args.metric}: give the value to reach with --target")
    args.target = 99.0 if args.target is None else args.target
    if problem := holdout.unreachable(args.metric, args.target):  # as the stages refuse it
        sys.exit(f"error: {problem}")
    runs = [measure(folder, rows, args.target, before or ()) for folder, rows, before in loaded]
    names = [name + (part(folder, rows, loaded) if before is not None else "")
             for name, (folder, rows, before) in zip(labels([folder for folder, _, _ in loaded]), loaded, strict=True)]  # fmt: skip
    text, paper = report(names, runs, args)
    print(text, end="")
    if args.out:
        save(args.out, lambda f: f.write(text.encode()))
    if args.plot:
        save(args.plot, lambda f: figure(runs, paper).savefig(f, format=args.plot.suffix[1:].lower(), dpi=100))


if __name__ == "__main__":
    early.run(main)  # guard: it ends with its status, even where a task left a thread running
