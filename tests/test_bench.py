"""bench/gpu/table.py, the table `make bench` prints: read from the H200 run committed beside it, every figure is the
one its README gives; a run that failed or is missing is a dash, never a figure."""

import importlib.util

from helpers import REPO

GPU = REPO / "bench" / "gpu"


def table(lines):
    spec = importlib.util.spec_from_file_location("table", GPU / "table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [line.split(" | ") for line in module.table(lines).splitlines() if line.startswith("| ")]
    return {what.removeprefix("| "): measured for what, measured, _ in rows[1:]}


def test_the_gpu_table_reads_the_h200_run_as_its_readme_gives_it():
    lines = (GPU / "h200-2026-11-26" / "results.txt").read_text().splitlines()
    rows = table(lines)
    assert rows["01 default vs pytorch/examples' classic pipeline, batch 64"] == "32,193 / 8,011 = 4.02×"
    assert rows["03 at 1 rank vs 01, batch 64 (two rounds)"] == "24,793 / 32,193 = 77 %; 27,783 / 31,414 = 88 %"
    assert rows["`--compile` vs eager, 01 batch 64"] == "28,969 / 32,193 = 0.90× (13.6 s compiling)"
    assert rows["time to 99 % test accuracy, the recipe (RECIPE)"] == "1.72 s, mean of 1 of 1 seeds (1.72)"
    assert (
        rows["planner vs measured peak (weights+grads+optimizer+gathered+activations)"] == "-16 % to +1 % over 6 runs"
    )
    assert rows["`--compile` vs eager, 05 batch 64"] == "–"  # p05c is not in results.txt
    readme = (GPU / "README.md").read_text()
    assert all(f"| {what} | {measured} |" in readme for what, measured in rows.items() if measured != "–"), rows
    failed = [line.replace("p01c rc=0", "p01c rc=1") for line in lines if not line.startswith("p01b")]
    rows = table(failed)
    assert rows["`--compile` vs eager, 01 batch 64"] == "–" and rows["03 at 1 rank vs 01, batch 64 (two rounds)"] == (
        "24,793 / 32,193 = 77 %; –"
    )


def test_the_gpu_table_reads_the_cuda_graph_run_as_its_readme_gives_it():
    """The later H200 run (the step one CUDA graph, the recipe search): its rows in the README are table.py's."""
    rows = table((GPU / "h200-2026-11-26c" / "results.txt").read_text().splitlines())
    assert rows["`--compile` vs eager, 01 batch 64"] == "109,637 / 28,721 = 3.82× (18.5 s compiling)"
    best = "time to 99 %, the recipe search's best, compiled: --batch-size 1024 --lr 2.0 --gamma 0.85"
    assert rows[best] == "1.62 s, mean of 4 of 5 seeds (2.29, 1.39, 1.22, 1.58)"  # seed 3 fell short: not averaged
    readme = (GPU / "README.md").read_text()
    assert all(f"| {what} | {measured} |" in readme for what, measured in rows.items() if measured != "–"), rows
