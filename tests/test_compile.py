"""--compile: the training of eager mode within a stated tolerance (compiled kernels fuse and reorder float
sums: rounding, nothing more), the same checkpoints, and a missing compiler refused in one line."""

import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import (
    HANG,
    INJECT,
    S01,
    S05,
    checkpoint,
    clean_env,
    free_port,
    metrics,
    one_error,
    python,
    spawn,
    stage_args,
    start,
    torchrun,
)
from test_equivalence import ARGS, BATCH, CPU, RUN, STEPS, model_without_dropout, stage, step
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common import data, models, optim
from common.metrics import Sums
from common.models import Net
from common.options import compiling, loaders

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # after 6 Adadelta steps of the Net; bitwise equality is not expected
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")  # a tensor read on the host


def both(rank, world_size, port, data_dir, name, result):
    """Train the Net without dropout for STEPS steps as stage `name` does, eager and then compiled: rank 0
    saves both training losses and both weights."""
    torch.set_num_threads(1)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    sampler = DistributedSampler(range(BATCH * STEPS), num_replicas=world_size, rank=rank, shuffle=False)
    loader = loaders.loader(data.dataset(data_dir, "mnist", train=True), list(sampler), BATCH // world_size, CPU, ARGS)
    found = {}
    for compiled in (False, True):
        model = model_without_dropout()
        if name == "05_fsdp":
            for block in models.blocks(model) if compiled else []:  # as stage 05 does: compile per block,
                block.compile()  # then shard
            for block in models.blocks(model):
                fully_shard(block)
            fully_shard(model)
        else:
            model = DDP(model) if world_size > 1 else model
        args = type(ARGS)(**vars(ARGS), grad_accum=1)  # stage 05's train() reads it
        run = step(model, args)
        if compiled and name != "05_fsdp":
            run = compiling.compiled(run, SimpleNamespace(compiled=0.0), ARGS)
        sums = stage(name).train(run, loader, 1, Sums.zeros(CPU), args, RUN)
        for total in (sums.loss, sums.samples) if world_size > 1 else ():
            dist.all_reduce(total)
        weights = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
        found[compiled] = (
            sums.loss / sums.samples,
            {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in weights.items()},
        )
    if rank == 0:
        torch.save(found, result)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name, world_size", [("01_single_gpu", 1), ("03_ddp_single_node", 2), ("05_fsdp", 2)])
def test_compiled_training_equals_eager_within_tolerance(name, world_size, tiny_data, tmp_path):
    spawn(both, (world_size, free_port(), tiny_data, name, tmp_path / "r.pt"), nprocs=world_size)
    found = torch.load(tmp_path / "r.pt", weights_only=True)
    (eager_loss, eager), (compiled_loss, compiled) = found[False], found[True]
    torch.testing.assert_close(compiled_loss, eager_loss, **TOLERANCE)
    assert compiled.keys() == eager.keys() and not any("_orig_mod" in k for k in compiled)
    start = model_without_dropout().state_dict()
    for key, value in eager.items():
        assert not torch.equal(value, start[key])  # training moved it, and compiled training moved it alike
        torch.testing.assert_close(compiled[key], value, **TOLERANCE)


@pytest.mark.slow
def test_compiled_and_eager_checkpoints_are_one_format(tiny_data, tmp_path):
    """A compiled run's checkpoint is an eager run's: the same keys (no _orig_mod), loaded strictly by stage
    01's Net; the weights load into a compiled model and back, computing the same. --compile defines the
    run: resuming with it changed is refused, naming it."""
    out = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--compile"))
    assert out.returncode == 0 and "| compile " in out.stdout, out.stderr
    assert out.stdout.count("compile: fused kernels, no CUDA graph: CUDA graphs need a GPU") == 1  # said once, why
    assert "warn" not in out.stderr.lower(), out.stderr  # the fallback is quiet
    weights = checkpoint(tmp_path)["model"]
    eager = Net().eval()
    eager.load_state_dict(weights, strict=True)
    compiled = Net().eval()
    compiled.compile()
    compiled.load_state_dict(eager.state_dict(), strict=True)
    assert compiled.state_dict().keys() == weights.keys()
    x = torch.randn(8, 1, 28, 28)
    torch.testing.assert_close(compiled(x), eager(x), **TOLERANCE)
    row = metrics(tmp_path)[0]  # the compiler's time in training, kept apart: not the evaluation's after it
    assert 0 < float(row["compile_seconds"]) < float(row["epoch_seconds"]), row
    one_error(python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 2, "--resume")), "--compile True (now False)")


@pytest.mark.slow
def test_stage_05_compiles_each_unit_at_each_shape(tiny_data, tmp_path):
    """Stage 05's units share one compiled frame: the Net's, trained and evaluated, each with a last smaller batch,
    passed dynamo's limit of 8 entries, and the rest ran eagerly ("hit config.recompile_limit"), unsaid by the stage;
    WideResNet's blocks of three widths made a dimension dynamic, which Inductor failed on (its headline model). A
    task whose blocks() returns none had nothing to compile: an IndexError; one line now."""
    net = torchrun(2, S05, *stage_args(tiny_data, tmp_path / "net", "--epochs", 1, "--batch-size", 24, "--compile"))
    assert net.returncode == 0 and "recompile_limit" not in net.stdout + net.stderr, net.stderr[-3000:]
    wide = ("--model", "wideresnet", "--dataset", "synthetic", "--depth", 10, "--width", 1, "--limit", 64)
    wrn = torchrun(
        2, S05, *stage_args(tiny_data, tmp_path / "wrn", "--epochs", 1, "--batch-size", 32, "--compile", *wide)
    )
    assert wrn.returncode == 0 and "recompile_limit" not in wrn.stdout + wrn.stderr, wrn.stderr[-3000:]
    (tmp_path / "t.py").write_text("from common.tasks.images import *\n\ndef blocks(model):\n    return []\n")
    none = python(
        S05, *stage_args(tiny_data, tmp_path / "none", "--task", tmp_path / "t.py", "--epochs", 1, "--compile")
    )
    one_error(none, "--compile compiles stage 05's units, the layers the task's blocks(model) returns", "leave out")


@pytest.mark.slow
def test_a_stop_mid_epoch_carries_the_compilers_seconds_of_its_part(tiny_data, tmp_path):
    """A compiled run stopped in its first epoch, after its compilation: the cut kept the epoch's seconds, not the
    compiler's among them, and the resumed row said 2.4 s outside the compiler where it was 16.6 s (a stop during
    the evaluation: a compile_seconds of 0). The cut keeps them; the resumed row counts both parts."""
    proc = start(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--compile", "--log-interval", 1),
                 env=clean_env(PYTHONPATH=INJECT, FAULT_RANK=0, FAULT_SLEEP=0.3))  # fmt: skip
    for line in proc.stdout:
        if " batch 2/" in line:  # compiled, and trained past it
            proc.send_signal(signal.SIGTERM)
            break
    output = line + proc.stdout.read()
    assert proc.wait(timeout=HANG) == 143 and "saved at epoch 1, step " in output, output[-2000:]
    cut = checkpoint(tmp_path)["log"]["cut"]
    assert 0 < cut["compiled"] < cut["seconds"], cut
    resumed = python(S01, *stage_args(tiny_data, tmp_path, "--epochs", 1, "--compile", "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    row = metrics(tmp_path)[0]
    assert cut["compiled"] <= float(row["compile_seconds"]) < float(row["epoch_seconds"]), (
        cut,
        row,
    )  # a warm cache: 0 more


@pytest.mark.slow
def test_compile_without_a_cpp_compiler_is_one_line(tiny_data, tmp_path):
    out = python(S01, *stage_args(tiny_data, tmp_path, "--compile"), PATH="/nonexistent", CXX="")
    one_error(out, "--compile on the CPU needs a C++ compiler")
    assert out.seconds < 30 and not (tmp_path / "checkpoint.pt").exists()


def graph_of(model, device, args):
    """The StepGraph compiling.compiled() makes of a step of `model`, or None where it steps eagerly."""
    eager = stage("01_single_gpu").train_step
    plain = optim.Step(model, device, None, None, None, eager)
    run = compiling.compiled(plain, SimpleNamespace(compiled=0.0), args).run
    return run if isinstance(run, compiling.StepGraph) else None


def test_compile_chooses_cuda_graphs_where_they_go(monkeypatch, capsys):
    """The whole step one CUDA graph (a StepGraph to record) for a plain model on a GPU; none on a CPU,
    under --amp, or around what a graph cannot hold: DDP's all-reduce hooks, DataParallel's threads. The
    choice is said once, with its reason; the model is compiled in place. (Stage 05 compiles each unit itself,
    says so, and records no graph.)"""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, **options: compiled.append(module))
    linear, gpu = torch.nn.Linear(2, 2), torch.device("cuda")  # compiling is lazy: no GPU is touched
    fp32, bf16 = type(ARGS)(**{**vars(ARGS), "amp": False}), type(ARGS)(**{**vars(ARGS), "amp": True})
    assert graph_of(linear, CPU, fp32) is None and compiled == [linear]
    assert capsys.readouterr().out == "compile: fused kernels, no CUDA graph: CUDA graphs need a GPU\n"
    assert isinstance(graph_of(linear, gpu, fp32), compiling.StepGraph)
    assert capsys.readouterr().out == "compile: fused kernels, the step one CUDA graph\n"
    assert graph_of(linear, gpu, bf16) is None and "--amp" in capsys.readouterr().out
    assert graph_of(torch.nn.DataParallel(linear), gpu, fp32) is None
    assert "DataParallel" in capsys.readouterr().out
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert graph_of(DDP(linear), gpu, fp32) is None
    finally:
        dist.destroy_process_group()
    assert "no CUDA graph: DDP's all-reduce hooks cannot be captured" in capsys.readouterr().out
    monkeypatch.setattr(compiling, "timed", lambda log, model: None)  # its callbacks: test_jobs.py
    compiling.units([linear], None)  # stage 05 said nothing of it ("says so", README.md)
    said = "compile: fused kernels per unit, no CUDA graph: the gathers run between the units\n"
    assert compiled[-1] is linear and capsys.readouterr().out == said


@pytest.mark.parametrize(
    "name, compiled",
    [("01_single_gpu", False), ("05_fsdp", False), pytest.param("01_single_gpu", True, marks=pytest.mark.slow)],
)
def test_no_host_sync_between_log_steps(name, compiled, monkeypatch):
    """A step reads no tensor on the host (a GPU would wait for it) except on --log-interval steps, for its
    progress line: one .item() each, eager and compiled (counted after the compiler's first steps)."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))) for _ in range(7)]
    model = model_without_dropout()
    run = step(model)
    if compiled:
        run = compiling.compiled(run, SimpleNamespace(compiled=0.0), ARGS)
    args = type(ARGS)(**{**vars(ARGS), "log_interval": 3, "grad_accum": 1})  # steps 0, 3 and 6 log
    train = stage(name).train
    if compiled:  # the compiler reads tensors while it compiles: once, before the steps counted
        train(run, batches, 1, Sums.zeros(CPU), args, RUN)
    reads = {method: 0 for method in SYNCS}
    for method in SYNCS:
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, counted(original, method, reads))
    sums = train(run, batches, 1, Sums.zeros(CPU), args, RUN)
    monkeypatch.undo()
    assert reads == {method: 3 if method == "item" else 0 for method in SYNCS}
    assert sums.samples == 56 and torch.isfinite(sums.loss)  # it trained all 7 steps


def counted(original, method, reads):
    def read(tensor, *args, **kwargs):
        reads[method] += 1
        return original(tensor, *args, **kwargs)

    return read
