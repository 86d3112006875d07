"""tools/scaling.py (`make scaling`): the scaling table of hand-written metrics, and of real 1- and 2-process
runs of stage 03 on tiny data."""

import csv
import importlib
import json
import os
import pickle
import re
import shutil
import sys
import warnings

import pytest
import torch
from helpers import REPO, S03, S05, launched, metrics, run, stage_args

from common.metrics import FIELDS

SCALING = REPO / "tools/scaling.py"
sys.path.insert(0, str(SCALING.parent))  # scaling.py imports plot.py from beside it, as when run as a script
scaling = importlib.import_module("scaling")


def table(text):
    """The rows of the Markdown table in `text`, as {column: cell}."""
    lines = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0]]
    return [dict(zip(header, [cell.strip() for cell in line], strict=True)) for line in lines[2:]]


def write_run(folder, world, rates, accuracy, seconds=(3, 2, 2, 2), val=None, **columns):
    """A metrics.csv as the stages write it, one row per epoch; `columns`: extra columns, the same every epoch."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS + [c for c in columns if c not in FIELDS])
        writer.writeheader()
        for epoch, (rate, acc, secs) in enumerate(zip(rates, accuracy, seconds, strict=True), 1):
            row = dict.fromkeys(FIELDS, 1.0)  # the columns the table does not read
            row.update(epoch=epoch, images_per_s=rate, test_accuracy=acc, epoch_seconds=secs, world_size=world)
            row.update(val_loss="", nodes="", val_accuracy="" if val is None else val[epoch - 1])  # nodes: an older run
            row.update(better="higher")
            row.update(columns)
            writer.writerow(row)
    return folder


def report(capsys, *args):
    scaling.main([*map(str, args)])
    return capsys.readouterr().out


def test_table_sorts_world_sizes_as_numbers_and_reads_the_steady_epochs(tmp_path, capsys):
    steady = {16: 1000, 2: 190, 8: 640, 1: 100, 4: 360}  # images/s after the first epoch, in the order given
    runs = []
    for n, rate in steady.items():
        reached = n != 4  # the 4-process run never reaches 99 %
        extra = dict(nodes=4, global_batch=1024) if n == 16 else {}  # nodes: recorded since; global_batch: may be
        accuracy = [90, 98, 99.2, 99.5] if reached else [90, 95, 97, 98.9]
        # 1 process: the test set reaches 99 % at epoch 3, but the validation set (which counts) never
        val = [90, 95, 97, 98] if n == 1 else None
        # a slow first epoch: counted in the median of all four epochs, it would move it off `rate`
        runs.append(write_run(tmp_path / f"w{n}", n, [5, 0.9 * rate, 1.1 * rate, rate], accuracy, val=val, **extra))
    text = report(capsys, *runs, "--out", tmp_path / "scaling.md")
    assert (tmp_path / "scaling.md").read_text() == text
    rows = table(text)
    assert [r["world size"] for r in rows] == ["1", "2", "4", "8", "16"]  # text would sort 1, 16, 2, 4, 8
    assert [r["run"] for r in rows] == ["w1", "w2", "w4", "w8", "w16"]
    for r in rows:
        n, rate = int(r["world size"]), steady[int(r["world size"])]
        assert r["images/s"] == f"{rate}"
        assert (r["speed-up"], r["efficiency"]) == (f"{rate / 100:.2f}", f"{rate / 100 / n:.2f}")
        assert r["time to 99%"] == ("not reached" if n in (1, 4) else "7.0 s")  # 3 + 2 + 2 s: through epoch 3
    assert [r["nodes"] for r in rows] == ["1", "?", "?", "?", "4"]  # one process is one node; else a column says
    assert [r["global batch"] for r in rows] == ["?", "?", "?", "?", "1024"]  # no checkpoint.pt: only a column says


def test_rows_on_paper_with_bandwidth(tmp_path, capsys):
    one = write_run(tmp_path / "one", 1, [500, 1000, 1000], [90, 95, 99], seconds=(1, 1, 1))
    two = write_run(tmp_path / "two", 2, [500, 1500, 1500], [90, 95, 99], seconds=(1, 1, 1))
    flags = dict(dataset="mnist", model="net", depth=16, width=4, batch_size=64)  # --batch-size is the global batch
    for folder in (one, two):  # of a checkpoint, the table reads the flags alone
        torch.save({"run": {"flags": flags}}, folder / "checkpoint.pt")
    text = report(capsys, two, one, "--bandwidth", 1, "--plot", tmp_path / "scaling.png")
    assert "1,199,882 fp32 gradients (4.8 MB) at 1 GB/s" in text  # the parameters of models.Net, counted
    rows = table(text)
    assert [(r["world size"], r["run"]) for r in rows] == [
        ("1", "one"), ("1", "on paper: 64.00 ms compute + 0.00 ms all-reduce"),
        ("2", "two"), ("2", "on paper: 32.00 ms compute + 4.80 ms all-reduce"),  # 2 (N-1)/N x 4.8 MB at 1 GB/s
    ]  # fmt: skip
    # 64 images in 32 ms of compute (1 ms per image at world size 1, half the batch each) + 4.8 ms of all-reduce
    assert [r["images/s"] for r in rows] == ["1000", "1000", "1500", f"{64 / (0.032 + 0.004799528):.0f}"]
    assert [r["global batch"] for r in rows] == ["64"] * 4
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bare = write_run(tmp_path / "bare", 2, [500, 2000], [90, 95], seconds=(1, 1), global_batch=64)
    with pytest.raises(SystemExit, match="--bandwidth needs --params"):
        scaling.main([str(bare), "--bandwidth", "1"])
    assert table(report(capsys, bare, "--bandwidth", 1, "--params", 1_000_000))[1]["run"] == (
        "on paper: 32.00 ms compute + 4.00 ms all-reduce"  # 2000 images/s of 2 processes: 1 ms per image each
    )


def test_the_models_size_is_the_one_the_run_records(tmp_path, capsys):
    """A run of a task of its own names no model of common/models.py: its manifest records the parameter
    count, which the rows on paper use (before a count that models.build() would make of its options);
    --params overrides it."""
    one = write_run(tmp_path / "one", 1, [500, 1000], [90, 95], seconds=(1, 1))
    two = write_run(tmp_path / "two", 2, [500, 1500], [90, 95], seconds=(1, 1))
    torch.save({"run": {"flags": {"batch_size": 64, "task": "mlp.py"}, "parameters": 1_000_000}}, one / "checkpoint.pt")
    named = {"batch_size": 64, "model": "net", "dataset": "mnist"}  # the recorded count wins over Net's 1,199,882
    torch.save({"run": {"flags": named, "parameters": 3_000_000}}, two / "checkpoint.pt")
    assert "1,000,000 fp32 gradients (4.0 MB) at 1 GB/s" in report(capsys, one, two, "--bandwidth", 1)
    assert "3,000,000 fp32 gradients" in report(capsys, two, "--bandwidth", 1)
    assert "250,000 fp32 gradients (1.0 MB)" in report(capsys, one, two, "--bandwidth", 1, "--params", 250_000)
    stamped = {"id": "f00d", "record": {"flags": named, "parameters": 2_000_000}}  # with its run's id (Stamp)
    torch.save({"run": stamped}, two / "checkpoint.pt")
    assert "2,000,000 fp32 gradients" in report(capsys, two, "--bandwidth", 1)


def test_runs_are_told_apart_by_the_stage_their_manifest_records_not_their_folder(tmp_path, capsys):
    """Runs with an --output-dir of their own: the stage was read from the folder's parent ("hunt2" for both, no
    note that one was FSDP), and stage 05's --grad-accum, 1, set beside a stage 03 run without the flag, was noted
    as a difference (1, None)."""
    for name, stage, flags in (("a", "03_ddp_single_node", {}), ("b", "05_fsdp", {"grad_accum": 1})):
        run = write_run(tmp_path / name, 1 + (name == "b"), [100, 100], [90, 95], seconds=(1, 1))
        record = {"flags": {"batch_size": 64, **flags}, "stage": stage}
        (run / "run-manifest.json").write_text(
            json.dumps({"run": name, "writes": [], "launch": None, "record": record})
        )
    text = report(capsys, tmp_path / "a", tmp_path / "b")
    assert "Note: these runs differ in stage: 03_ddp_single_node (a), 05_fsdp (b).\n" in text, text


def test_a_model_common_models_does_not_know_is_one_line():
    """A run written before checkpoints recorded the parameter count, of a task with a --model of its own:
    the count models.build() would make of its options is refused in one line, not a traceback."""
    run = {"flags": {"model": "transformer", "dataset": "mnist"}, "parameters": None}
    with pytest.raises(SystemExit, match=r"^error: unknown model 'transformer': net, cnn or wideresnet$"):
        scaling.parameters(run, None)


@pytest.mark.slow
def test_a_sharded_run_records_the_whole_models_size(uninterrupted, tmp_path, capsys):
    """Stage 05 on 2 ranks: each holds half of every parameter, its manifest records the whole Net's count. The run
    is a copy of the one test_fsdp.py compares with stage 03's, trained once (conftest.py `uninterrupted`)."""
    shutil.copytree(uninterrupted(2, S05, "--epochs", 1, "--save-model"), tmp_path / "run", symlinks=True)
    manifest = json.loads((tmp_path / "run" / "run-manifest.json").read_text())
    assert manifest["record"]["parameters"] == 1_199_882  # models.Net
    assert "1,199,882 fp32 gradients" in report(capsys, tmp_path / "run", "--bandwidth", 1)


@pytest.mark.slow
def test_without_matplotlib_a_plot_is_refused(tmp_path):
    hide = "import sys, runpy; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; sys.path.insert(0, sys.argv[0].rpartition('/')[0]); runpy.run_path(sys.argv[0], run_name='__main__')"
    result = run([sys.executable, "-c", hide, str(SCALING), str(tmp_path), "--plot", str(tmp_path / "s.png")])
    assert (result.returncode, result.stderr) == (1, "error: --plot needs matplotlib: pip install matplotlib\n")


@pytest.mark.slow
def test_real_runs_of_one_and_two_processes(uninterrupted, tiny_data, tmp_path, capsys):
    runs = [tmp_path / f"gloo{n}" for n in (1, 2)]
    # two epochs: the first is warm-up, the median is the second. At 2 ranks, a copy of the run test_preemption.py's
    # stops at 2 ranks resume to, trained once (conftest.py `uninterrupted`); at 1, the same options
    options = ("--epochs", 2, "--batch-size", 32)
    result = launched(1, S03, *stage_args(tiny_data, runs[0], *options))
    assert result.returncode == 0, result.stderr
    shutil.copytree(uninterrupted(2, S03, *options), runs[1], symlinks=True)
    written = [metrics(folder) for folder in runs]
    # as `make scaling` runs it, in a process of its own; then in this one, for a target no run reaches
    result = run([sys.executable, str(SCALING), *map(str, reversed(runs)), "--target-accuracy", "50"])
    assert result.returncode == 0, result.stderr
    for target, text in ((50, result.stdout), (100, report(capsys, *runs, "--target-accuracy", 100))):
        rows = table(text)
        assert [(r["world size"], r["nodes"], r["global batch"]) for r in rows] == [("1", "1", "32"), ("2", "1", "32")]
        assert (rows[0]["speed-up"], rows[0]["efficiency"]) == ("1.00", "1.00")
        for r, epochs in zip(rows, written, strict=True):
            assert r["images/s"] == f"{float(epochs[1]['images_per_s']):.0f}"  # the median of the one after the first
            seconds, reached = 0.0, "not reached"
            for e in epochs:  # training seconds through the first epoch whose test accuracy reaches the target
                seconds += float(e["epoch_seconds"])
                if float(e["test_accuracy"]) >= target:
                    reached = f"{seconds:.1f} s"
                    break
            assert r[f"time to {target:g}%"] == reached
        speedup = float(rows[1]["images/s"]) / float(rows[0]["images/s"])  # from the printed, rounded numbers
        assert float(rows[1]["speed-up"]) == pytest.approx(speedup, abs=0.01)
        assert float(rows[1]["efficiency"]) == pytest.approx(speedup / 2, abs=0.01)
    assert {r["time to 100%"] for r in rows} == {"not reached"}  # tiny_data: no run is right on all


def test_stage05_runs_resumed_at_another_world_size_and_mixed_settings(tmp_path, capsys):
    """A stage 05 run reads its global batch from its sharded checkpoint, splits into a row per world size
    it ran at (requeued from 4 ranks onto 2), and a table mixing stages and models says so above it."""
    ddp = write_run(tmp_path / "03_ddp_single_node" / "a", 1, [100] * 4, [90, 95, 97, 98])
    torch.save({"run": {"flags": {"batch_size": 64, "model": "net", "dataset": "mnist"}}}, ddp / "checkpoint.pt")
    fsdp = write_run(tmp_path / "05_fsdp" / "b", 4, [380, 400, 190, 200], [90, 95, 97, 98])
    rows = metrics(fsdp)
    for row in rows[2:]:
        row["world_size"] = 2
    with open(fsdp / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, rows[0].keys())
        writer.writeheader()
        writer.writerows(rows)
    (fsdp / "epoch-4").mkdir()
    torch.save(
        {"run": {"flags": {"batch_size": 128, "model": "cnn", "dataset": "mnist"}}}, fsdp / "epoch-4" / "state.pt"
    )
    (fsdp / "checkpoint").symlink_to("epoch-4")
    text = report(capsys, ddp, fsdp)
    assert [(r["world size"], r["global batch"], r["images/s"], r["run"]) for r in table(text)] == [
        ("1", "64", "100", "03_ddp_single_node/a"), ("2", "128", "200", "05_fsdp/b (world size 2)"),
        ("4", "128", "400", "05_fsdp/b (world size 4)"),
    ]  # fmt: skip
    assert "Note: these runs differ in stage: 03_ddp_single_node (03_ddp_single_node/a), 05_fsdp (05_fsdp/b" in text
    assert "--model: net (03_ddp_single_node/a), cnn (05_fsdp/b (world size 2)), cnn (05_fsdp/b (world size 4))" in text


def test_the_time_to_target_of_a_run_resumed_at_other_world_sizes_counts_from_its_start(tmp_path, capsys):
    """Ran at 2 ranks, requeued onto 1, then 2 again, reaching 99 % in its fifth epoch, 40 s into its training: each
    part counted its own seconds from 0 ("10.0 s" at world size 2, and two rows named alike)."""
    run = write_run(
        tmp_path / "05_fsdp" / "r", 2, [100] * 6, [50, 60, 70, 80, 99.5, 99.6], seconds=(10, 10, 5, 5, 10, 10)
    )
    rows = metrics(run)
    for row in rows[2:4]:
        row["world_size"], row["images_per_s"] = 1, 200
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, rows[0].keys())
        writer.writeheader()
        writer.writerows(rows)
    parts = {r["run"]: r["time to 99%"] for r in table(report(capsys, run))}
    assert parts == {
        "05_fsdp/r (world size 1)": "not reached",
        "05_fsdp/r (world size 2, epochs 1-2)": "not reached",
        "05_fsdp/r (world size 2, epochs 5-6)": "40.0 s (from 2)",
    }
    later = {r["run"]: r["time to 70%"] for r in table(report(capsys, run, "--target-accuracy", 70))}
    assert later["05_fsdp/r (world size 1)"] == "25.0 s (from 2)" and later["05_fsdp/r (world size 2, epochs 5-6)"] == (
        "at world size 1"  # reached in an earlier part
    )


@pytest.mark.parametrize("target, hint", [("0.99", "reached at once (did you mean 99?)"), ("150", "never reached")])
def test_a_target_of_accuracy_outside_its_percent_is_refused_as_the_stages_refuse_it(tmp_path, target, hint):
    """--target 0.99 on accuracy, in %: every run's time to it was its first epoch's (0.2 s); 150 was never reached.
    The stages refuse both in one line (holdout.unreachable()); so does the table."""
    run = write_run(tmp_path / "a", 1, [100, 100], [90, 99], seconds=(1, 1))
    with pytest.raises(SystemExit) as stop:
        scaling.main([str(run), "--target", target])
    assert stop.value.code == f"error: --target {target}: accuracy is in %, from 0 to 100: {target} % is {hint}"


@pytest.mark.parametrize("bandwidth", ["0", "-1", "nan"])
def test_a_bandwidth_that_is_no_speed_is_a_usage_error(tmp_path, capsys, bandwidth):
    run = write_run(tmp_path / "a", 1, [100, 100], [90, 99], seconds=(1, 1))
    with pytest.raises(SystemExit) as stop:
        scaling.main([str(run), "--bandwidth", bandwidth, "--params", "1000"])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: argument --bandwidth: must be a number in (0, inf), got {bandwidth} (see --help)\n"
    )


class Payload:
    """A pickle that would create `marker` when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["code", "truncated", "no flags"])
def test_a_checkpoint_of_another_kind_is_one_line_and_runs_nothing(tmp_path, kind):
    run = write_run(tmp_path / "a", 1, [100, 100], [90, 99], seconds=(1, 1))
    saved = run / "checkpoint.pt"
    if kind == "code":
        with open(saved, "wb") as f:
            pickle.dump({"run": {"flags": Payload(tmp_path / "ran")}}, f)
    else:
        torch.save({"run": {"flags": {"batch_size": 64}}} if kind == "truncated" else {"model": {}}, saved)
        saved.write_bytes(saved.read_bytes()[: -100 if kind == "truncated" else None])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as stop:
        warnings.simplefilter("always")
        scaling.main([str(run)])
    assert str(stop.value.code).startswith(f"error: {saved} is not a checkpoint of these stages, or is damaged")
    assert "leave the run out" in stop.value.code and "\n" not in stop.value.code
    assert not caught and not (tmp_path / "ran").exists()  # no warning beside the line; the pickle's code never ran


def test_a_bar_in_a_run_folders_name_keeps_the_table(tmp_path, capsys):
    text = report(capsys, write_run(tmp_path / "a|b", 1, [100, 100], [90, 99], seconds=(1, 1)))
    line = text.splitlines()[-1]
    assert line.endswith(r"| a\|b |") and len(re.split(r"(?<!\\)\|", line)) == 10  # 8 cells between 9 bars


@pytest.mark.parametrize("flag, name", [("--out", "missing/scaling.md"), ("--plot", "missing/scaling.png"),
                                        ("--plot", "scaling.txt"), ("--out", ".")])  # fmt: skip
def test_an_output_it_cannot_write_is_one_line_before_any_work(tmp_path, capsys, flag, name):
    run = write_run(tmp_path / "a", 1, [100, 100], [90, 99], seconds=(1, 1))
    with pytest.raises(SystemExit) as stop:
        scaling.main([str(run), flag, str(tmp_path / name)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: argument {flag}: ") and err.count("\n") == 1, err
    assert ("mkdir -p" if "missing" in name else "png" if "txt" in name else "is a folder") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # nothing written, no folder made


def test_one_run_named_twice_is_one_line(tmp_path, capsys):
    """A run's folder and its metrics.csv, both named: two identical rows without a word."""
    run = write_run(tmp_path / "a", 1, [100, 100], [90, 99], seconds=(1, 1))
    with pytest.raises(SystemExit) as stop:
        scaling.main([str(run), str(run / "metrics.csv")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert f"{(run / 'metrics.csv').resolve()} is named twice (a run's folder and its metrics.csv are one run)" in err


def test_a_metrics_csv_whose_rows_repeat_is_one_line_naming_it(tmp_path, capsys):
    """Two copies of one run's rows in one metrics.csv gave a speed-up of 0.84 between them; epochs that do not
    increase are no run's: one line naming the file and the line."""
    run = write_run(tmp_path / "w1", 1, [5, 90, 110, 100], [90, 98, 99.2, 99.5])
    text = (run / "metrics.csv").read_text()
    (run / "metrics.csv").write_text(text + text.split("\n", 1)[1])
    with pytest.raises(SystemExit) as refused:
        scaling.main([str(run)])
    assert str(refused.value).startswith(
        f"error: {run / 'metrics.csv'}, line 6: epoch 1 follows epoch 4, rows repeated"
    )


def test_several_runs_at_the_smallest_world_size_have_no_baseline_picked_by_their_order(tmp_path, capsys, monkeypatch):
    """Two runs of one process (a sweep's batch sizes) and one of two: the first named was the baseline, the other
    one-process run had a speed-up and an efficiency of 2.00 at its own size, and naming them in another order gave
    other numbers. Now "?" and a note naming them; one of them named alone is the baseline."""
    small = write_run(tmp_path / "bs32", 1, [50, 100, 100], [90, 95, 99], seconds=(1, 1, 1))
    large = write_run(tmp_path / "bs128", 1, [100, 200, 200], [90, 95, 99], seconds=(1, 1, 1))
    two = write_run(tmp_path / "two", 2, [100, 300, 300], [90, 95, 99], seconds=(1, 1, 1))
    outs = [report(capsys, *order) for order in ([small, large, two], [two, large, small])]
    assert outs[0] == outs[1], outs  # the order they are named in changes nothing
    assert "Speed-up and efficiency: ?, as 2 runs share the smallest world size, 1 (bs128, bs32)" in outs[0], outs[0]
    assert [(row["speed-up"], row["efficiency"]) for row in table(outs[0])] == [("?", "?")] * 3
    rows = table(report(capsys, large, two))
    assert [(row["speed-up"], row["efficiency"]) for row in rows] == [("1.00", "1.00"), ("1.50", "0.75")]
    monkeypatch.chdir(two)  # a run named `.`: its row's run cell was empty
    assert [row["run"] for row in table(report(capsys, large, "."))] == ["bs128", "two"]
