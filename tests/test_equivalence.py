"""The claims DDP makes, checked with the stages' own functions on gloo."""

import ast
import importlib.util
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import REPO, S03, S05, TEST_SIZE, free_port, launched, spawn, stage_args
from no_guard import NoGuard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from common import data, metrics, optim
from common.models import Net
from common.options import holdout, loaders

BATCH, STEPS = 32, 6
ARGS = SimpleNamespace(
    log_interval=10**6, output_dir="unused", dry_run=False, amp=False, loader="batched", num_workers=0, seed=1,
    checkpoint_minutes=None, batch_size=BATCH,
)  # fmt: skip
CPU = torch.device("cpu")


RUN = NoGuard()  # the lesson alone: the guard rails only observe it (tests/test_observers.py)


def step(model, args=ARGS):
    """What the stages' train() and evaluate() take: Adadelta at lr 1, the default loss, score."""
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    eager = stage("01_single_gpu").train_step  # every stage's
    return optim.Step(model, CPU, optimizer, F.cross_entropy, metrics.accuracy, eager)


def stage(name):
    spec = importlib.util.spec_from_file_location(name, REPO / name / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_without_dropout():
    torch.manual_seed(0)
    model = Net()
    model.dropout1.p = model.dropout2.p = 0.0  # dropout draws different masks per process
    return model


def ddp_options(name):
    """The keyword arguments of a stage's one DDP(...) call but device_ids, read from its train.py."""
    [call] = [node for node in ast.walk(ast.parse((REPO / name / "train.py").read_text()))
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DDP"]  # fmt: skip
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "device_ids"}


OPTIONS = ddp_options("03_ddp_single_node")


def ddp_rank(rank, world_size, port, data_dir, runs):
    """For each (file, DDP options) of `runs`, one after another in one process group: a fresh model, one epoch
    of stage 03's train(); rank 0 saves its weights to the file."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    sampler = DistributedSampler(range(BATCH * STEPS), num_replicas=world_size, rank=rank, shuffle=False)
    for result, options in runs:
        train_set = data.dataset(data_dir, "mnist", train=True)
        loader = loaders.loader(train_set, list(sampler), BATCH // world_size, CPU, ARGS)
        model = DDP(model_without_dropout(), **options)  # as the stage builds it
        stage("03_ddp_single_node").train(step(model), loader, 1, metrics.Sums.zeros(CPU), ARGS, RUN)
        if rank == 0:
            torch.save(model.module.state_dict(), result)
    dist.destroy_process_group()


def test_two_ranks_with_half_batches_equal_one_process(tiny_data, tmp_path):
    """DDP over 2 ranks with B/2 each ends with the parameters of one process with batch B."""
    spawn(ddp_rank, (2, free_port(), tiny_data, [(tmp_path / "ddp.pt", OPTIONS)]), nprocs=2)
    loader = loaders.loader(data.dataset(tiny_data, "mnist", train=True), range(BATCH * STEPS), BATCH, CPU, ARGS)
    model = model_without_dropout()
    stage("01_single_gpu").train(step(model), loader, 1, metrics.Sums.zeros(CPU), ARGS, RUN)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    start = model_without_dropout().state_dict()
    for name, value in model.state_dict().items():
        assert not torch.equal(value, start[name])  # training moved every tensor...
        torch.testing.assert_close(ddp[name], value, rtol=0, atol=1e-6)  # ...and both runs moved it alike


def test_the_stages_ddp_options_train_bit_identically_to_plain_ddp(tiny_data, tmp_path):
    """Stages 03 and 04 wrap the model alike, and their DDP options (gradient_as_bucket_view=True: the gradients
    views of DDP's buckets, no copy; bench/ddp_profile.py) change no bit of training: one rank, two epochs of 6
    steps, with dropout."""
    assert ddp_options("03_ddp_single_node") == ddp_options("04_ddp_multi_node")
    loader = data.loader(data.dataset(tiny_data, "mnist", train=True), range(BATCH * STEPS), BATCH, CPU)
    trained = []
    for options in ({}, OPTIONS):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg{len(trained)}", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = DDP(Net(), **options)
            for epoch in (1, 2):
                stage("03_ddp_single_node").train(step(model), loader, epoch, metrics.Sums.zeros(CPU), ARGS, RUN)
            trained.append(model.module.state_dict())
        finally:
            dist.destroy_process_group()
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0]), OPTIONS


@pytest.mark.slow
def test_the_stages_ddp_options_train_bit_identically_on_two_ranks(spawned):
    """Two ranks with half batches, the stage's DDP options against none: the same bits. Both trainings run in
    one pair of processes, one after the other, each from a fresh model (ddp_rank(), in the pair of processes
    conftest.py `spawned` shares among the checks that start two ranks)."""
    plain, stage_ = (torch.load(spawned / name, weights_only=True) for name in ("plain.pt", "stage.pt"))
    assert all(torch.equal(plain[k], stage_[k]) for k in plain), OPTIONS


def assert_counted_once(output, model_file, data_dir, val_fraction=0.0):
    """The run's epoch line holds what one process computes over every test image (and every image of the
    validation split) exactly once."""
    line = next(line for line in output.splitlines() if line.startswith("epoch "))
    model = Net()
    model.load_state_dict(torch.load(model_file, weights_only=True))
    test_set = data.dataset(data_dir, "mnist", train=False)
    loader = loaders.loader(test_set, range(TEST_SIZE), 1000, CPU, ARGS)
    sums = stage("01_single_gpu").evaluate(step(model), loader, TEST_SIZE, RUN)
    loss, correct, count = sums.loss.item(), sums.score.item(), sums.samples.item()
    assert count == TEST_SIZE
    assert f"accuracy {int(correct)}/{TEST_SIZE} ({100 * correct / count:.2f}%)" in line, line
    assert f"test loss {loss / count:.4f}" in line, line
    if val_fraction:
        _, val_set = holdout.split(data.dataset(data_dir, "mnist", train=True), val_fraction, seed=1)
        loader = loaders.loader(val_set, range(len(val_set)), 1000, CPU, ARGS)
        sums = stage("01_single_gpu").evaluate(step(model), loader, len(val_set), RUN)
        loss, correct, count = sums.loss.item(), sums.score.item(), sums.samples.item()
        assert f"val loss {loss / count:.4f} ({100 * correct / count:.2f}%)" in line, line


def test_evaluation_counts_every_test_image_once(tiny_data, tmp_path):
    """World size 3 over 10 test images in batches of 3 (4, 3, 3 images: 2, 1, 1 batches before padding): the
    all-reduced count is 10, the result the single-process one."""
    args = stage_args(tiny_data, tmp_path, "--epochs", 1, "--batch-size", 63, "--test-batch-size", 3, "--save-model")
    out = launched(3, S03, *args)
    assert out.returncode == 0, out.stderr
    assert_counted_once(out.stdout, tmp_path / "model.pt", tiny_data)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_fsdp_evaluates_uneven_shards_without_waiting(tiny_data, tmp_path, world_size):
    """Stage 05 on splits the world size does not divide, in batches that would leave one rank a batch more:
    under FSDP every forward is a collective, so unequal batch counts would wait out --dist-timeout. 10 test
    images and a 13-image validation split, in batches of 2 at 2 ranks (7 and 6 images) and of 1 at 3 and 7."""
    batch = {2: 2, 3: 1, 7: 1}[world_size]
    extra = ["--epochs", 1, "--batch-size", 14 * world_size, "--test-batch-size", batch, "--dist-timeout", 30]
    args = stage_args(tiny_data, tmp_path, *extra, "--val-fraction", 0.05, "--save-model")
    start = time.monotonic()
    out = launched(world_size, S05, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - start < 25 + 5 * world_size  # no rank waited for a partner
    assert_counted_once(out.stdout, tmp_path / "model.pt", tiny_data, val_fraction=0.05)
