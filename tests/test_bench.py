"""bench/gpu/table.py, the table `make bench` prints: read from the H200 run committed beside it, every figure is the
one its README gives; a run that failed or is missing is a dash, never a figure."""

import importlib.util
import re
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import REPO, clean_env, free_port, run

GPU = REPO / "bench" / "gpu"


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_measure_sh_reads_the_compile_line_compiling_py_prints(capsys):
    """measure.sh's compile note greps the runs' logs for the line compiling.compiled() prints: it grepped
    '^compile: mode', which nothing printed, and its note was always empty."""
    from common import optim
    from common.options import compiling

    step = optim.Step(torch.nn.Linear(2, 2), torch.device("cpu"), None, None, None, None)
    compiling.compiled(step, SimpleNamespace(compiled=0.0), SimpleNamespace(amp=False))
    printed = capsys.readouterr().out.splitlines()
    patterns = re.findall(r"grep -m1 '(\^compile[^']*)'", (GPU / "measure.sh").read_text())
    assert patterns and all(any(re.search(p, line) for line in printed) for p in patterns), (patterns, printed)


def test_fsdp_cost_bare_loop_shards_and_steps_as_stage_05(tmp_path):
    """bench/fsdp_cost.py's stage/bare ratio compares one set-up: its bare loop shards stage 05's units (for the
    Net, fc1 alone: models.gathered) and the root, not every block, and steps Adadelta by foreach, as stage 05."""
    from torch.distributed.fsdp import FSDPModule

    from common import models

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model, optimizer = load(REPO / "bench" / "fsdp_cost.py").built(torch.device("cpu"))
        units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        plain = models.build("net", 1, 10, 28)
        named = {m: name for name, m in plain.named_modules()}
        assert units == ["", *(named[m] for m in models.gathered(models.blocks(plain)))] == ["", "fc1"], units
        assert optimizer.defaults["foreach"] is True
    finally:
        dist.destroy_process_group()


SMALLEST = {  # each bench script on the CPU at its smallest size: (arguments, environment). Not bench.py (make
    # benchmarks): its CPU rows compile stage 01, minutes on a CPU at any size
    "check_cost.py": ([], {"N": "2"}),
    "ddp_profile.py": (["--eager", "--steps", "2"], {}),
    "fsdp_cost.py": (["--rounds", "1", "--limit", "16", "--batch-size", "4"], {}),
    "gpu/step_probe.py": ([], {"N": "2"}),
    "gpu/fsdp_probe.py": ([], {"N": "2"}),
    "gpu/recipes.py": (["1", "1"], {"QUICK": "1"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", SMALLEST)
def test_each_bench_script_runs_on_the_cpu_at_its_smallest_size(script, tmp_path):
    args, env = SMALLEST[script]
    cmd = [sys.executable, str(REPO / "bench" / script), *(a.format(tmp=tmp_path) for a in args)]
    out = run(cmd, env=clean_env(MASTER_PORT=free_port(), **env), timeout=900)  # two probes side by side
    assert out.returncode == 0 and "Traceback" not in out.stderr and out.stdout.strip(), (
        out.stdout,
        out.stderr[-3000:],
    )
