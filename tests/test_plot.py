"""tools/plot.py (`make plot`): the metrics of real runs of stage 01 become one PNG, a line per run."""

import csv
import importlib.util
import sys

import pytest
from helpers import REPO, run, stage_args

pytestmark = pytest.mark.slow
PLOT = REPO / "tools/plot.py"
BATCH_SIZES = [16, 32, 64]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Three runs of stage 01, two epochs each, in folders named as sweeps/ names them: bs16, bs32, bs64."""
    pytest.importorskip("matplotlib")  # before training for nothing
    root = tmp_path_factory.mktemp("runs")
    runs = [root / f"bs{bs}" for bs in BATCH_SIZES]
    for bs, folder in zip(BATCH_SIZES, runs, strict=True):
        args = stage_args(tiny_data, folder, "--epochs", 2, "--batch-size", bs)
        result = run([sys.executable, str(REPO / "01_single_gpu/train.py"), *args])
        assert result.returncode == 0, result.stderr
    return runs


def test_plot_draws_one_line_per_run(runs, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    png = tmp_path / "plot.png"
    result = run([sys.executable, str(PLOT), *map(str, runs), "-o", str(png)])  # as `make plot` runs it
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.imread(png).shape == (800, 1100, 4)  # 11 x 8 inches at 100 dpi, RGBA

    spec = importlib.util.spec_from_file_location("plot", PLOT)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    fig = plot.main([*map(str, runs), "-o", str(tmp_path / "again.png")])
    *per_epoch, timing = fig.axes
    metrics = [list(csv.DictReader(open(r / "metrics.csv"))) for r in runs]
    for ax, column in zip(per_epoch, ["train_loss", "test_loss", "test_accuracy"], strict=True):
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["bs16", "bs32", "bs64"], ax.get_title()
        for line, rows in zip(lines, metrics, strict=True):
            assert list(line.get_xdata()) == [1, 2]
            assert list(line.get_ydata()) == pytest.approx([float(r[column]) for r in rows])
    # one point per run, at the batch size read from its folder's name
    assert [list(line.get_xdata()) for line in timing.get_lines()] == [[bs] for bs in BATCH_SIZES]
    assert timing.get_xlabel().startswith("bs")


def test_plot_without_matplotlib_says_so(tmp_path):
    hide = "import sys, runpy; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    result = run([sys.executable, "-c", hide, str(PLOT), str(tmp_path), "-o", str(tmp_path / "plot.png")])
    assert (result.returncode, result.stderr) == (1, "error: tools/plot.py needs matplotlib: pip install matplotlib\n")
    assert not (tmp_path / "plot.png").exists()


def test_plot_names_a_folder_without_metrics(tmp_path):
    result = run([sys.executable, str(PLOT), str(tmp_path)])
    assert result.returncode == 1 and f"no metrics in {tmp_path}" in result.stderr
