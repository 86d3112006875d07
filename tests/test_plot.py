"""tools/plot.py (`make plot`): the metrics of runs become one PNG, a line per run, labelled and ordered by what
tells runs apart; written by hand, and of real runs of stage 01."""

import csv
import errno
import importlib
import importlib.util
import os
import shutil
import sys

import pytest
from helpers import REPO, S01, metrics, run, stage_args

from common.metrics import FIELDS

PLOT = REPO / "tools/plot.py"
BATCH_SIZES = [16, 32, 64]


def load_plot():
    """tools/plot.py as a module, to read the figure its main() returns."""
    spec = importlib.util.spec_from_file_location("plot", PLOT)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    return plot


def write_metrics(folder, world, epochs=2):
    """A metrics.csv as the stages write it; the losses and times tell the runs apart by world size."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for epoch in range(1, epochs + 1):
            row = dict.fromkeys(FIELDS, 1.0)  # the columns the plot does not tell apart
            row.update(epoch=epoch, train_loss=world / epoch, epoch_seconds=10 / world, world_size=world)
            writer.writerow(dict(row, val_loss="", val_accuracy="", better="higher"))  # no validation set
    return folder


def test_legend_names_stage_world_size_and_run_in_numeric_order(tmp_path):
    pytest.importorskip("matplotlib")
    given = [  # (stage, run folder, world size), in the order of a shell glob: text order
        ("03_ddp_single_node", "101", 1), ("03_ddp_single_node", "116", 16), ("03_ddp_single_node", "102", 2),
        ("03_ddp_single_node", "104", 4), ("04_ddp_multi_node", "10", 8), ("04_ddp_multi_node", "9", 8),
        ("03_ddp_single_node", "108", 8), ("02_dataparallel", "7", 1),
    ]  # fmt: skip
    runs = [write_metrics(tmp_path / stage / name, world) for stage, name, world in given]
    fig = load_plot().main([*map(str, runs), "-o", str(tmp_path / "plot.png")])
    *per_epoch, timing = fig.axes
    expected = [  # world size as a number, then stage and run folder, "9" before "10"
        "02_dataparallel, 1 process, 7", "03_ddp_single_node, 1 process, 101",
        "03_ddp_single_node, 2 processes, 102", "03_ddp_single_node, 4 processes, 104",
        "03_ddp_single_node, 8 processes, 108", "04_ddp_multi_node, 8 processes, 9",
        "04_ddp_multi_node, 8 processes, 10", "03_ddp_single_node, 16 processes, 116",
    ]  # fmt: skip
    for ax in [*per_epoch, timing]:
        assert [line.get_label() for line in ax.get_lines()] == expected, ax.get_title()
    assert [text.get_text() for text in per_epoch[0].get_legend().get_texts()] == expected
    worlds = [1, 1, 2, 4, 8, 8, 8, 16]
    train_loss = per_epoch[0].get_lines()
    assert [list(line.get_ydata()) for line in train_loss] == [[n / 1, n / 2] for n in worlds]  # each its own data
    assert [list(line.get_xdata()) for line in timing.get_lines()] == [[n] for n in worlds]
    assert timing.get_xlabel() == "world size (processes)"


def test_a_run_resumed_at_another_world_size_is_drawn_at_each(tmp_path):
    """Stage 05 at 2 ranks, requeued onto 1: labelled "2 processes", its median epoch time (of both sizes) drawn at
    world size 2 alone."""
    pytest.importorskip("matplotlib")
    run = write_metrics(tmp_path / "05_fsdp" / "r", 2, epochs=4)
    rows = list(csv.DictReader((run / "metrics.csv").read_text().splitlines()))
    for row in rows[2:]:
        row.update(world_size=1, epoch_seconds=10)
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, rows[0].keys())
        writer.writeheader()
        writer.writerows(rows)
    *per_epoch, timing = load_plot().main([str(run), "-o", str(tmp_path / "plot.png")]).axes
    assert [line.get_label() for line in per_epoch[0].get_lines()] == ["05_fsdp, 2 then 1 processes, r"]
    points = [(list(line.get_xdata()), list(line.get_ydata())) for line in timing.get_lines()]
    assert points == [([2], [5.0]), ([1], [10.0])]  # each part's median, at its world size


@pytest.fixture(scope="module")
def runs(uninterrupted, tiny_data, tmp_path_factory):
    """Three runs of stage 01, two epochs each, in folders named as sweeps/ names them: bs16, bs32, bs64. bs32 is a
    copy of the run test_preemption.py's stops resume to, trained once (conftest.py `uninterrupted`)."""
    pytest.importorskip("matplotlib")  # before training for nothing
    root = tmp_path_factory.mktemp("runs")
    runs = [root / f"bs{bs}" for bs in BATCH_SIZES]
    for bs, folder in zip(BATCH_SIZES, runs, strict=True):
        if bs == 32:
            shutil.copytree(uninterrupted("python", S01, "--epochs", 2, "--batch-size", 32), folder, symlinks=True)
            continue
        args = stage_args(tiny_data, folder, "--epochs", 2, "--batch-size", bs)
        result = run([sys.executable, S01, *args])
        assert result.returncode == 0, result.stderr
    return runs


@pytest.mark.slow
def test_plot_draws_one_line_per_run(runs, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    png = tmp_path / "plot.png"
    result = run([sys.executable, str(PLOT), *map(str, runs), "-o", str(png)])  # as `make plot` runs it
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.imread(png).shape == (800, 1100, 4)  # 11 x 8 inches at 100 dpi, RGBA

    fig = load_plot().main([*map(str, reversed(runs)), "-o", str(tmp_path / "again.png")])  # in any order
    *per_epoch, timing = fig.axes
    written = [metrics(r) for r in runs]
    names = [f"01_single_gpu, 1 process, {r.name}" for r in runs]  # the stage they record; bs16, bs32, bs64: by number
    for ax, column in zip(per_epoch, ["train_loss", "test_loss", "test_accuracy"], strict=True):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == names, ax.get_title()
        for line, rows in zip(lines, written, strict=True):
            assert list(line.get_xdata()) == [1, 2]
            assert list(line.get_ydata()) == pytest.approx([float(r[column]) for r in rows])
    # one point per run, at the batch size read from its folder's name
    assert [list(line.get_xdata()) for line in timing.get_lines()] == [[bs] for bs in BATCH_SIZES]
    assert timing.get_xlabel().startswith("bs")


@pytest.mark.slow
def test_plot_without_matplotlib_says_so(tmp_path):
    hide = "import sys, runpy; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    result = run([sys.executable, "-c", hide, str(PLOT), str(tmp_path), "-o", str(tmp_path / "plot.png")])
    assert (result.returncode, result.stderr) == (1, "error: tools/plot.py needs matplotlib: pip install matplotlib\n")
    assert not (tmp_path / "plot.png").exists()


def test_plot_names_a_folder_without_metrics(tmp_path):
    result = run([sys.executable, str(PLOT), str(tmp_path)])
    assert result.returncode == 1 and f"no metrics in {tmp_path}" in result.stderr


HEADER = "epoch,world_size,epoch_seconds,images_per_s,test_accuracy\n"


@pytest.mark.parametrize(
    "text, named",
    [
        ("epoch,lr\n1,1.0\n", "no epoch_seconds, images_per_s, test_accuracy, world_size column"),
        (HEADER + "1,2,x,4,5\n", "line 2: could not convert string to float: 'x'"),
        (HEADER + "1,2,3,4,5\n2,2,3\n", "line 3: 3 cells under a header of 5"),
        (HEADER + "1,2,3,4,5,6\n", "line 2: 6 cells under a header of 5"),
        (b"\xff\xfe\x00", "line 1: 'utf-8' codec can't decode"),
    ],
)
def test_a_damaged_metrics_file_is_one_line_for_both_tools(tmp_path, text, named):
    """The tools read what a crashed disk or an editor left: one line naming the file and the line, no traceback.
    In this process (each tool's main(), as test_a_cell_no_stage_writes_is_one_line_for_both_tools): an exception
    other than the one-line exit fails the test as a traceback would."""
    (tmp_path / "metrics.csv").write_bytes(text if isinstance(text, bytes) else text.encode())
    sys.path.insert(0, str(PLOT.parent))  # scaling.py imports plot.py from beside it, as when run as a script
    tools = (load_plot().main, importlib.import_module("scaling").main)
    for main in tools if named.startswith("no ") else tools[:1]:  # the same load()
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path)])
        message = str(stop.value.code)  # a text: exit status 1
        assert message.startswith(f"error: {tmp_path / 'metrics.csv'}") and named in message, message
        assert "\n" not in message, message


@pytest.mark.parametrize(
    "rows, named",
    [
        ("1,2,3,4," + "9" * 200_000 + "\n", "line 2: field larger than field limit (131072)"),
        ("1,0,3,4,5\n", "line 2: world_size 0 is not a number of processes"),
        ("1,,3,4,5\n", "line 2: no world_size"),
        ("1,1,3,100,5\n2,1,3,0,5\n", "line 3: images_per_s 0 is not a rate"),  # the base of every speed-up
        ("1,1,3,nan,5\n", "line 2: images_per_s nan is not a rate"),
        ("1,1,-1,4,5\n", "line 2: epoch_seconds -1 is not a duration"),  # a time to 99 % of -1 s
        ("1.5,1,3,4,5\n", "line 2: epoch 1.5 is not an epoch"),
        ("1,1e40,3,4,5\n", "line 2: world_size 1e+40 is not a number of processes"),
        ("1,1,3,4,nan\n", "line 2: test_accuracy nan is not a value a run logs"),
    ],
    ids=[
        "a huge field",
        "world size 0",
        "no world size",
        "0 images/s",
        "nan images/s",
        "-1 s",
        "epoch 1.5",
        "world size 1e40",
        "nan accuracy",
    ],
)
def test_a_cell_no_stage_writes_is_one_line_for_both_tools(tmp_path, rows, named):
    """What a division or Python's csv module would stop on with a traceback: the file named, and its line."""
    (tmp_path / "metrics.csv").write_text(HEADER + rows)
    sys.path.insert(0, str(PLOT.parent))  # scaling.py imports plot.py from beside it, as when run as a script
    scaling = importlib.import_module("scaling")
    for main in (load_plot().main, scaling.main):
        with pytest.raises(SystemExit) as stop:
            main([str(tmp_path), "-o" if main is not scaling.main else "--out", str(tmp_path / "out.png")])
        message = str(stop.value.code)
        assert message.startswith(f"error: {tmp_path / 'metrics.csv'}, {named}") and "\n" not in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


@pytest.mark.parametrize("name, named", [("missing/plot.png", "no folder"), ("plot.txt", "matplotlib writes"),
                                         ("plot", "a name without one"), (".", "is a folder")])  # fmt: skip
def test_an_output_it_cannot_write_is_one_line_before_any_work(tmp_path, capsys, name, named):
    """A folder that does not exist is not made (a typo in it would scatter plots): the line says to make it."""
    pytest.importorskip("matplotlib")
    run = write_metrics(tmp_path / "run", 1)
    with pytest.raises(SystemExit) as stop:
        load_plot().main([str(run), "-o", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: argument -o/--output: ") and err.count("\n") == 1, err
    assert named in err and ("png, ps" in err if "txt" in name else "mkdir -p" in err if "missing" in name else True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written, no folder made


def test_a_metric_direction_that_is_neither_higher_nor_lower_is_refused(tmp_path):
    """`better` decides whether a target is reached at or above it or at or below: a damaged one is one line."""
    folder = write_metrics(tmp_path / "run", 1)
    text = (folder / "metrics.csv").read_text().replace(",higher", ",sideways")
    (folder / "metrics.csv").write_text(text)
    with pytest.raises(SystemExit, match=r"line 2: better is 'sideways', neither higher nor lower"):
        load_plot().load(folder)


def test_a_metrics_file_a_spreadsheet_saved_reads_as_the_run_wrote_it(tmp_path):
    """Saved again as "CSV UTF-8" by a spreadsheet, a metrics.csv starts with a byte order mark: its first column
    was "\ufeffepoch", and both tools (load(), which scaling.py shares) refused it as a file with no epoch column."""
    folder = write_metrics(tmp_path / "run", 1)
    written = load_plot().load(folder)[1]
    (folder / "metrics.csv").write_bytes(b"\xef\xbb\xbf" + (folder / "metrics.csv").read_bytes())
    saved_again = load_plot().load(folder)[1]
    assert saved_again == written and saved_again[0]["epoch"] == 1


@pytest.mark.parametrize("first", ["accuracy", "mae"])
def test_runs_of_different_metrics_are_one_line_for_both_tools(tmp_path, first):
    """A task's mae beside MNIST's accuracy: the plot labelled both "test accuracy (%)" and the table timed the mae
    run to "99 %", reached at once since lower is better (or, with the mae run first, refused the accuracy run's
    99). Whichever comes first, one line naming each run's metric; nothing written."""
    pytest.importorskip("matplotlib")  # the plot's check of -o comes first
    accuracy = write_metrics(tmp_path / "accuracy", 1)
    mae = write_metrics(tmp_path / "mae", 2)
    text = (mae / "metrics.csv").read_text().replace("_accuracy", "_mae").replace(",higher", ",lower")
    (mae / "metrics.csv").write_text(text)
    runs = [str(accuracy), str(mae)] if first == "accuracy" else [str(mae), str(accuracy)]
    sys.path.insert(0, str(PLOT.parent))  # scaling.py imports plot.py from beside it, as when run as a script
    scaling = importlib.import_module("scaling")
    for main, out in ((load_plot().main, "-o"), (scaling.main, "--out")):
        with pytest.raises(SystemExit) as stop:
            main([*runs, out, str(tmp_path / "out.png")])
        message = str(stop.value.code)
        assert message.startswith("error: these runs measure different things (") and "\n" not in message, message
        assert f"{accuracy}: accuracy, higher is better" in message and f"{mae}: mae, lower is better" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy", "mae"]


def test_an_output_never_replaces_a_runs_file_nor_follows_a_link(tmp_path, capsys):
    """`--out run/metrics.csv` replaced the run's metrics with Markdown; a FIFO as --out blocked for ever; --out and
    --plot on one file lost one of them; a link as the output had its target overwritten; a write that failed (a
    full disk) left half an image and a traceback. Each is one line; the old file stays whole."""
    run = write_metrics(tmp_path / "run", 1)
    os.mkfifo(tmp_path / "fifo.md")
    sys.path.insert(0, str(PLOT.parent))  # scaling.py imports plot.py from beside it, as when run as a script
    scaling = importlib.import_module("scaling")
    for argv, said in [(["--out", run / "metrics.csv"], "a run writes files of that name"),
                       (["--out", tmp_path / "fifo.md"], "is not a regular file"),
                       (["--out", tmp_path / "a.png", "--plot", tmp_path / "a.png"], "one would replace the other")]:  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            scaling.main([str(run), *map(str, argv)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and said in err and err.count("\n") == 1, err
    victim = tmp_path / "victim.md"
    victim.write_text("the user's")
    (tmp_path / "link.md").symlink_to(victim)
    scaling.main([str(run), "--out", str(tmp_path / "link.md")])
    assert victim.read_text() == "the user's" and "| world size |" in (tmp_path / "link.md").read_text()

    def full(f):
        f.write(b"half an image")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SystemExit, match=r"^error: could not write .*link\.md: No space left on device: nothing"):
        load_plot().save(tmp_path / "link.md", full)
    assert "| world size |" in (tmp_path / "link.md").read_text() and sorted(os.listdir(tmp_path)) == [
        "fifo.md", "link.md", "run", "victim.md"]  # fmt: skip
