"""tools/plan.py: its state figures are the bytes real FSDP and HSDP runs hold, its activations what a real
training step saves, and its answer a job script's #SBATCH lines."""

import fcntl
import json
import os
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers import HANG, REPO, free_port, run, shared, spawn
from test_equivalence import ARGS, RUN, stage, step
from torch.distributed._composable import checkpoint as recompute
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from common import cli, data, models, optim
from common.metrics import Sums
from common.options import amp, loaders

sys.path.insert(0, str(REPO / "tools"))
import plan  # noqa: E402

SMALL = ["--model", "wideresnet", "--depth", "10", "--width", "1", "--dataset", "cifar10", "--batch-size", "8"]
MESHES = {1: None, 2: (2,), 4: (4,), "2x2": (2, 2)}  # world size or "nodes x ranks": the mesh of stage 05


def local_bytes(tensors):
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors if t.dim())


def held(rank, world_size, port, sizes, result):
    """Rank 0's bytes of weights, gradients and optimizer state in stage 05's sharding on the mesh of each of
    `sizes` (of one world size), a fresh model each, one after another in one process group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    found = {}
    for size in sizes:
        shape = MESHES[size]
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = plan.build(plan.parse(SMALL))
        for norm in models.norms(model):  # as stage 05 shards: BatchNorm layers, blocks, root
            fully_shard(norm, mesh=mesh)
        for block in models.blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = optim.optimizer(plan.parse(SMALL), model.parameters())
        model(torch.randn(4, 3, 32, 32)).sum().backward()
        optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        grads = [p.grad for p in model.parameters()]
        found[str(size)] = [local_bytes(model.parameters()), local_bytes(grads), local_bytes(state)]
    if rank == 0:
        torch.save(found, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def measured_at(request, tmp_path_factory):
    """measured_at(size): held()'s bytes on the mesh of `size`. At 2 ranks, among the checks that share a pair of
    processes (conftest.py `spawned`); the meshes of 4 ranks (FSDP over all four, HSDP 2 x 2) in one spawn of their
    own, once per pytest run, whichever worker asks first (the others wait for it)."""

    def measured(size):
        if size == 2:
            return torch.load(request.getfixturevalue("spawned") / "held-2.pt", weights_only=True)["2"]
        out = shared(tmp_path_factory) / "plan-held-4.pt"
        with open(f"{out}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                part = out.with_name(f"{out.name}.{os.getpid()}")
                spawn(held, (4, free_port(), [4, "2x2"], part), nprocs=4)
                part.replace(out)
        return torch.load(out, weights_only=True)[str(size)]

    return measured


@pytest.mark.slow
@pytest.mark.parametrize("size", list(MESHES))
def test_the_plans_state_is_what_fsdp_and_hsdp_hold(size, measured_at):
    args = plan.parse(SMALL + ["--gpus-per-node", "2"])
    world_size = 4 if size == "2x2" else size
    measured = plan.measure(args)
    strategy = {1: "DDP", "2x2": "HSDP"}.get(size, "FSDP")
    planned = plan.per_gpu(args, world_size, measured)[strategy]
    if size == 1:  # one process: the whole model, as DDP (and stage 05 without a launcher) holds it
        model = plan.build(args)
        optimizer = optim.optimizer(args, model.parameters())
        model(torch.randn(4, 3, 32, 32)).sum().backward()
        optimizer.step()
        found = [local_bytes(model.parameters()), local_bytes(p.grad for p in model.parameters()),
                 local_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]  # fmt: skip
    else:
        found = measured_at(size)
    assert found == [planned["weights"], planned["gradients"], planned["optimizer"]]


def test_the_plans_activations_are_what_a_training_step_saves(tiny_data):
    """Stage 01's train() at a batch of 8, its saved tensors counted by the same hooks: the plan's figure,
    which it extrapolated from batches of 1 and 2."""
    args = plan.parse(["--batch-size", "8", "--optimizer", "adadelta"])
    planned = plan.per_gpu(args, 1, plan.measure(args))["DDP"]["activations"]
    model = plan.build(args)
    batch = [(torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))]
    train = stage("01_single_gpu").train  # step(): Adadelta and the built-in task's loss, the stage's defaults
    sums = Sums.zeros(torch.device("cpu"))
    assert saved_bytes(model, lambda: train(step(model), batch, 1, sums, ARGS, RUN)) == planned > 0


def saved_bytes(model, step):
    """Bytes of the tensors `step` saves for backward, counted once by storage, the weights of `model` left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(saved.values())


MLP = """# A task of its own: an MLP on random vectors of 12 numbers in 3 classes, with its own loss and blocks.
import torch
import torch.nn.functional as F
from torch import nn


def model(args):
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))


def datasets(args):
    generator = torch.Generator().manual_seed(0)
    vectors = torch.randn(40, 12, generator=generator)
    labels = torch.randint(3, (40,), generator=generator)
    return torch.utils.data.TensorDataset(vectors[:32], labels[:32]), torch.utils.data.TensorDataset(vectors[32:], labels[32:])


def loss(output, target):
    return F.cross_entropy(output**2, target)  # the square saves the output: more than cross-entropy alone


def blocks(model):
    return [model[:2], model[2:]]
"""


def test_another_tasks_model_data_loss_and_blocks_are_planned(tmp_path, capsys):
    """--task: its model, a batch shaped as its training samples, its loss and its blocks (the largest unit
    FSDP gathers is its second block, not the largest Linear that common/models.py's blocks() would find)."""
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    args = plan.parse(["--task", str(path), "--batch-size", "8"])
    measured = plan.measure(args)
    task = cli.load_task(path)
    assert sum(p.numel() for p in measured[0].parameters()) == 12 * 64 + 64 + 64 * 64 + 64 + 64 * 3 + 3
    assert measured[3] == 64 * 64 + 64 + 64 * 3 + 3
    assert measured.next_unit == 12 * 64 + 64  # prefetched while the largest runs: not a second largest (2x overstated)
    gathered = plan.per_gpu(args, 2, measured)["FSDP"]["gathered"]
    assert gathered == 4 * (measured.unit + measured.next_unit) < 4 * 2 * measured.unit
    model = plan.build(args)
    x, y = (t.clone() for t in task.datasets(args)[0][:8])  # a batch of its own, as a DataLoader collates it
    real = saved_bytes(model, lambda: task.loss(model(x), y).backward())
    assert plan.per_gpu(args, 1, measured)["DDP"]["activations"] == real > 0
    plan.main(["--task", str(path), "--batch-size", "8", "--max-gpus", "2"])
    out = capsys.readouterr().out
    assert out.startswith(f"{path} (5,187 parameters), global batch 8, adadelta") and "| 2 | FSDP |" in out  # not 0.0 M


KINDS = [  # each kind of STATE with the settings that change its state: (class, settings)
    *((kind, {}) for kind in plan.STATE),
    *((kind, {"amsgrad": True}) for kind in ("Adam", "AdamW")),
    ("SGD", {"momentum": 0.9}),
    ("RMSprop", {"momentum": 0.9, "centered": True}),
]


@pytest.mark.parametrize("kind, settings", KINDS, ids=lambda v: v if isinstance(v, str) else ",".join(v) or "-")
def test_the_plans_optimizer_state_is_what_each_torch_optimizer_keeps(kind, settings):
    """STATE against torch: the bytes of the per-parameter state one step leaves (its scalars aside)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    optimizer = getattr(torch.optim, kind)(model.parameters(), lr=0.01, **settings)
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    kept = local_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    assert kept == plan.STATE[kind](optimizer.param_groups[0]) * local_bytes(model.parameters())


def test_the_plan_counts_the_optimizer_the_task_trains_with(tmp_path, capsys):
    """A task's own optimizer() was planned as --optimizer's: its SGD (no state) as Adadelta's two tensors a
    weight, an Adam over --optimizer sgd as none (the plan said it fits; the run ran out of memory)."""
    path = tmp_path / "mlp.py"
    own = "\ndef optimizer(args, model):\n    return torch.optim.{}(model[2:].parameters(), lr=0.1)\n"
    head = sum(p.numel() for p in torch.nn.Linear(64, 64).parameters()) * 4  # model[2:]: the last two layers
    head += sum(p.numel() for p in torch.nn.Linear(64, 3).parameters()) * 4
    for kind, argv, tensors in (("SGD", [], 0), ("Adam", ["--optimizer", "sgd"], 2)):
        path.write_text(MLP + own.format(kind))
        args = plan.parse(["--task", str(path), "--batch-size", "8", *argv])
        assert plan.per_gpu(args, 1, plan.measure(args))["DDP"]["optimizer"] == tensors * head
        plan.main(["--task", str(path), "--batch-size", "8", "--max-gpus", "1", *argv])
        assert f"global batch 8, the task's {kind};" in capsys.readouterr().out
    path.write_text(MLP + "\nclass Lion(torch.optim.SGD):\n    pass\n" + own.format("Lion").replace("torch.optim.", ""))
    with pytest.raises(SystemExit, match=r"^error: the task's optimizer\(\) is a task_mlp.Lion, whose state the"):
        plan.main(["--task", str(path), "--batch-size", "8"])


class Live(TorchDispatchMode):
    """The most bytes of tensor storages alive at once while it is on: each new storage counted until freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is not None and storage.data_ptr() and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.freed, storage.data_ptr(), storage.nbytes())
        return out

    def freed(self, pointer, nbytes):
        self.live -= nbytes
        self.seen.discard(pointer)


def test_recomputed_blocks_are_planned_as_stage_05_runs_them_and_ddp_without():
    """--checkpoint-activations: the plan counted the blocks' inputs alone (12 MiB for a WRN-10-1 at batch 64, whose
    training step peaks at 29 MiB: a block runs again in the backward), and its DDP rows too, though stages 03 and 04
    refuse the flag: its answer, stage 03, either refused it or ran out of memory."""
    argv = ["--model", "wideresnet", "--depth", "10", "--width", "1", "--dataset", "cifar10", "--batch-size", "64"]
    plain, recomputed = plan.parse(argv), plan.parse([*argv, "--checkpoint-activations"])
    planned = {args.checkpoint_activations: plan.per_gpu(args, 1, plan.measure(args)) for args in (plain, recomputed)}
    assert planned[True]["DDP"] == planned[False]["DDP"]  # stages 03, 04: no block recomputed
    model = plan.build(recomputed)
    for block in models.blocks(model):
        recompute(block)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(10, (64,))
    model.train()
    with Live() as live:
        F.cross_entropy(model(x), y).backward()
    gradients = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = live.peak - gradients  # what the step keeps beyond the weights' gradients
    assert 0.9 * peak <= planned[True]["FSDP"]["activations"] < planned[False]["FSDP"]["activations"], peak


def test_micro_batches_are_planned_for_stage_05_alone_and_its_mesh_across_nodes(capsys):
    """--grad-accum 4 left the plan as it was (stage 05 holds one micro-batch's activations), and its advice was
    "a smaller --batch-size (with --grad-accum)"; an FSDP answer on two nodes ran as HSDP, stage 05's there, which
    the plan said did not fit, unless --full-shard, which it did not say."""
    argv = ["--model", "wideresnet", "--depth", "10", "--width", "1", "--dataset", "cifar10", "--batch-size", "64"]
    whole, micro = plan.parse(argv), plan.parse([*argv, "--grad-accum", "4"])
    quarter = plan.parse(argv[:-1] + ["16"])  # one micro-batch: a global batch a quarter as large
    rows = {a.grad_accum * a.batch_size: plan.per_gpu(a, 2, plan.measure(a)) for a in (whole, quarter)}
    accumulated = plan.per_gpu(micro, 2, plan.measure(micro))
    assert accumulated["FSDP"]["activations"] == rows[16]["FSDP"]["activations"] < rows[64]["FSDP"]["activations"]
    assert accumulated["DDP"]["activations"] == rows[64]["DDP"]["activations"]  # stages 03, 04: the whole batch
    big = ["--model", "wideresnet", "--depth", "28", "--width", "10", "--dataset", "cifar10", "--batch-size", "8"]
    big += ["--test-batch-size", "8"]  # training's memory decides, not the evaluation's
    fits = [*big, "--optimizer", "adam", "--lr", "0.001", "--gpus-per-node", "2", "--max-gpus", "8"]
    for extra, said in ((["--gpu-memory", "1.3"], "4 GPUs, FSDP (05_fsdp/job.slurm with --full-shard)"),
                        (["--gpu-memory", "1.42"], "4 GPUs, HSDP (05_fsdp/job.slurm)"),
                        (["--gpu-memory", "3", "--grad-accum", "2"], "1 GPU, DDP (03_ddp_single_node/job.slurm "
                         "without --grad-accum, stage 05's)")):  # fmt: skip
        plan.main([*fits, *extra])  # in this process: the answer alone is checked, not the launch
        out = capsys.readouterr().out
        assert f"the smallest allocation that fits: {said}" in out, out[-800:]
    plan.main([*big, "--gpu-memory", "0.5", "--max-gpus", "1", "--amp"])
    said = "nothing fits in 1 GPUs of 0.5 GiB: stage 05 with --checkpoint-activations, --grad-accum N (the same"
    assert said in capsys.readouterr().out


def test_micro_batches_are_those_stage_05_runs_not_grad_accums_number(capsys):
    """torch.chunk makes fewer slices than --grad-accum where a rank's share does not split so: 10 samples in 6 are
    five of 2, and one sample is one. The plan counted --grad-accum's number: 6 sent more than 5 (71 ms where stage 05
    runs the same step as at 5, 60 ms), and one sample in 2 held the whole gradients unsharded (10 MiB, not 5)."""
    argv = ["--model", "wideresnet", "--depth", "10", "--width", "1", "--dataset", "cifar10", "--amp"]
    sent = {n: plan.traffic(plan.parse([*argv, "--batch-size", "20", "--grad-accum", str(n)]), 1e6, "FSDP", 2)
            for n in (5, 6, 10, 20)}  # fmt: skip
    assert sent[5] == sent[6] < sent[10] == sent[20]
    assert plan.micro_batches(plan.parse([*argv, "--batch-size", "20", "--grad-accum", "6"]), 2) == (5, 2)
    one = plan.parse([*argv, "--batch-size", "2", "--grad-accum", "2"])
    parts = plan.per_gpu(one, 2, plan.measure(one))["FSDP"]
    assert parts["gradients"] == parts["weights"]  # sharded, as with --grad-accum 1


def accumulated(rank, world_size, port, result):
    """Stage 05's step of four micro-batches under --amp at 2 ranks (its policies, large.accumulating()): the bytes
    of gradients rank 0 holds after the first micro-batch, and the bytes of every all-gather's and reduce-scatter's
    whole tensor in the step (a ring sends (n - 1)/n of them)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    args = plan.parse([*SMALL, "--amp", "--grad-accum", "4"])
    model = plan.build(args)
    block_policy, norm_policy, root_policy = amp.policies(torch.device("cpu"), args)
    for norm in models.norms(model):
        fully_shard(norm, mp_policy=norm_policy)
    for block in models.blocks(model):
        fully_shard(block, mp_policy=block_policy)
    fully_shard(model, mp_policy=root_policy)
    sent = [0]

    def counted(collective, whole):  # whole: the index of its whole tensor among the arguments
        def call(*a, **k):
            sent[0] += (list(a) + list(k.values()))[whole].nbytes
            return collective(*a, **k)

        return call

    # FSDP2's calls, by this torch's name (all_gather_single from 2.12) or an older one's
    for name, whole in (("all_gather_single", 0), ("all_gather_into_tensor", 0)):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name), whole))
    for name, whole in (("reduce_scatter_single", 1), ("reduce_scatter_tensor", 1)):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name), whole))
    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    held = []
    for i, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4), strict=True)):
        model.set_requires_gradient_sync(i == 3)
        F.cross_entropy(model(xm), ym).backward()
        if i == 0:  # FSDP2's gradients kept unsharded until the reduction (its own attributes: none is public)
            for state in (m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")):
                for param in state._fsdp_param_group.fsdp_params if state._fsdp_param_group else []:
                    grads = [getattr(param, "unsharded_accumulated_grad", None), param.unsharded_param.grad]
                    held += [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
    if rank == 0:
        torch.save({"held": sum(g.nbytes for g in held), "sent": sent[0]}, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_stage_05s_micro_batches_are_planned_with_their_unsharded_gradients_and_their_traffic(tmp_path):
    """--grad-accum 4 at 2 ranks: the FSDP row counted half the gradients, sharded, where every rank holds the whole
    model's until the last micro-batch reduces them; and its traffic as one micro-batch's all-gathers in fp32, where
    each micro-batch gathers the weights twice, in bf16 under --amp."""
    result = tmp_path / "accumulated.pt"
    spawn(accumulated, (2, free_port(), result), nprocs=2)
    found = torch.load(result, weights_only=True)
    args = plan.parse([*SMALL, "--amp", "--grad-accum", "4"])
    measured = plan.measure(args)
    whole = plan.shard_bytes(measured.model.parameters(), 1)
    assert found["held"] == whole == plan.per_gpu(args, 2, measured)["FSDP"]["gradients"]
    sent = plan.traffic(args, whole, "FSDP", 2)[0] / (1 / 2)  # the whole tensors: a ring of 2 sends half
    assert abs(found["sent"] - sent) <= 0.02 * sent, (found["sent"], sent)


def test_an_evaluation_is_planned_as_the_stage_evaluates():
    """Stage 01's evaluate() at a per-rank test batch of 200 (2 ranks, 600 test images): the plan's figure, the tensors
    alive at once in its forward. Before, the plan had no evaluation: a transformer whose evaluation batch of 1000
    needed 20 GiB was planned as fitting in 16; now the total counts the larger of it and training's activations."""
    args = plan.parse(["--test-batch-size", "200", "--limit", "600"])
    planned = plan.per_gpu(args, 2, plan.measure(args))
    model = plan.build(args)
    test_set = data.dataset(REPO / "data", "mnist", False, 600)
    loader = data.loader(test_set, data.shard(600, 0, 2).indices, 200, torch.device("cpu"))
    with Live() as live:
        live.seen |= {p.untyped_storage().data_ptr() for p in model.parameters()}  # the weights: their own column
        stage("01_single_gpu").evaluate(step(model), loader, 300, RUN)
    assert planned["DDP"]["evaluation"] <= live.peak <= planned["DDP"]["evaluation"] + 64, live.peak  # its sums
    parts = planned["DDP"]
    assert parts["evaluation"] > parts["activations"]
    assert plan.total(parts) == sum(parts.values()) - parts["activations"]
    # stage 05 under --amp evaluates in bf16 (its policy casts every forward): a WRN-10-2's peak is no line through
    # batches 2 and 3 (the weights' casts decide there): counted at its batch, 64, it was 8.3 MiB for 18.8
    args = plan.parse(["--amp", "--test-batch-size", "64", *SMALL[:5], "2", *SMALL[6:]])
    model, x, y = plan.build(args).eval(), torch.randn(64, 3, 32, 32), torch.randint(10, (64,))
    with torch.no_grad(), Live() as live, torch.autocast("cpu", dtype=torch.bfloat16):
        live.seen |= {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        F.cross_entropy(model(x), y)
    assert plan.per_gpu(args, 2, plan.measure(args))["FSDP"]["evaluation"] == live.peak + x.nbytes + y.nbytes


def test_the_data_set_on_each_gpu_is_planned_under_loader_device(tmp_path, capsys):
    """--loader device holds every split on each GPU, normalized to float32 (704 MiB for CIFAR-10): the plan left
    it out, a third of what a WRN-16-4 at batch 256 needs."""
    args = plan.parse(["--loader", "device", "--limit", "100", "--max-gpus", "1"])
    held = 0
    for train in (True, False):
        on = loaders.OnDevice(data.dataset(REPO / "data", "mnist", train, 100), range(100), 10, torch.device("cpu"))
        held += on.images.nbytes + on.labels.nbytes
    assert plan.per_gpu(args, 1, plan.measure(args))["DDP"]["data"] == held == 2 * 100 * (28 * 28 * 4 + 8)
    assert "data" not in plan.per_gpu(plan.parse([]), 1, plan.measure(plan.parse([])))["DDP"]
    (tmp_path / "own.py").write_text(MLP)
    with pytest.raises(SystemExit, match=r"^error: --loader device holds the built-in data sets"):
        plan.main(["--task", str(tmp_path / "own.py"), "--loader", "device"])
    assert capsys.readouterr().out == ""  # its one line alone: it came after the model's line and the table's head


def test_a_tasks_samples_are_planned_at_the_longest(capsys):
    """A text task's batch is padded to its longest text: the plan shaped it as the first training sample, and its
    activations went with --seed (4, 8, 9 MiB for first texts of 177, 1775, 2058 tokens of at most 4096)."""
    args = plan.parse(["--task", "common/tasks/text.py", "--max-len", "4096", "--seed", "1"])
    task = cli.load_task(args.task)
    train = task.datasets(args)[0]
    longest = max(len(train[i][0]) for i in range(0, len(train), max(len(train) // plan.SPREAD, 1)))
    planned, tests = plan.sample(args, task)
    assert len(planned[0]) == longest > 2 * len(train[0][0]) and tests == len(task.datasets(args)[1])


def test_the_plan_answers_with_sbatch_lines_in_seconds():
    out = run([sys.executable, REPO / "tools/plan.py", "--model", "wideresnet", "--depth", "16", "--width", "4",
               "--dataset", "cifar10", "--batch-size", "4096", "--gpu-memory", "4", "--gpus-per-node", "4",
               "--bandwidth", "23"], timeout=HANG)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "| 8 | HSDP |" in out.stdout and "comm. ms/step" in out.stdout
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in lines
        if line[:3] == "| " + line[2:3] and line[2].isdigit()
    ]
    fits = next(line for line in lines if line.startswith("| GPUs")).split("|")[1:-1].index(" fits ")
    fitting = sorted(int(row[0]) for row in rows if row[fits] == "yes")
    nodes, tasks, gres = (int(line.split("=")[1].split(":")[-1]) for line in lines if line.startswith("#SBATCH"))
    assert fitting and nodes * tasks == fitting[0] and gres == tasks  # the smallest that fits, nothing smaller


@pytest.mark.slow
def test_a_model_too_large_for_this_machine_is_counted_without_its_memory():
    """WideResNet-16-1000 has 170 G parameters: counted on fake tensors, with 6 GiB of address space (torch's
    libraries fit, the first of the model's 9 GB convolutions does not), in seconds. Past what even fake
    tensors hold (a tensor over 2^63 bytes), one line."""
    limit = "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30,) * 2); sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    out = run([sys.executable, "-c", limit, REPO / "tools/plan.py", "--model", "wideresnet", "--dataset", "cifar10",
               "--width", "1000"], timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    args = plan.parse(["--model", "wideresnet", "--dataset", "cifar10", "--width", "1000"])
    with torch.device("meta"):  # the parameters counted another way: shapes alone
        count = sum(p.numel() for p in plan.build(args).parameters())
    assert out.stdout.startswith(f"wideresnet ({count / 1e6:.1f} M parameters)") and count > 1e11
    assert "nothing fits in 16 GPUs" in out.stdout
    with pytest.raises(SystemExit, match=r"^error: this model cannot be counted \(.*\): a smaller --width or --depth$"):
        plan.main(["--model", "wideresnet", "--dataset", "cifar10", "--width", str(10**9)])


def test_a_model_the_lesson_refuses_is_its_line_and_a_tasks_own_error_is_not(tmp_path):
    """models.build()'s refusal (--depth 15) is the lesson's line; a ValueError of a task's own model()
    is no refusal of the lesson: it keeps its type and traceback."""
    with pytest.raises(SystemExit, match=r"^error: --depth 15: a WideResNet is 6n\+4 layers deep, n >= 1 "):
        plan.main(["--model", "wideresnet", "--dataset", "cifar10", "--depth", "15"])
    task = tmp_path / "my_task.py"
    task.write_text("from common.tasks.images import *\ndef model(args):\n    raise ValueError('no such layer')\n")
    with pytest.raises(ValueError, match="^no such layer$"):
        plan.main(["--task", str(task)])


def test_every_allocation_of_part_of_a_node_or_whole_nodes_is_tried(capsys):
    """Three GPUs per node: 3 fit where 2 do not, and 3 is the answer (1, 2, 4, 8, 16 alone: nothing fits)."""
    argv = SMALL[:-1] + ["36", "--gpus-per-node", "3", "--max-gpus", "12"]  # 36 images: every world size divides it
    argv += ["--test-batch-size", "4"]  # training's memory decides, not the evaluation's
    args = plan.parse(argv)
    measured = plan.measure(args)
    two, three = (plan.total(plan.per_gpu(args, n, measured)["FSDP"]) for n in (2, 3))
    plan.main(argv + ["--gpu-memory", str((two + three) / 2 / 2**30)])
    out = capsys.readouterr().out
    sizes = [int(line.split("|")[1]) for line in out.splitlines() if line[:2] == "| " and line[2].isdigit()]
    assert sorted(set(sizes)) == [1, 2, 3, 6, 9, 12]  # part of one node, or whole nodes
    assert "the smallest allocation that fits: 3 GPUs" in out
    assert "DDP (03_ddp_single_node/job.slurm)" in out  # one task, torchrun, starts the 3 ranks
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:3" in out


def doctor_json(path, slowest):
    """A doctor.json as tools/doctor.py writes it on two nodes of two ranks (`make doctor` writes one on this
    machine: tests/test_doctor.py): each rank's [bytes, algbw, busbw] sweeps, the largest size last."""
    ranks = [
        {"rank": rank, "host": f"node{rank // 2}", "bandwidth": {
            "across nodes": [[2**20, 0.1, 0.2], [2**24, 9.0, 13.5], [2**28, 10.0, 15.0 - rank]],
            "within nodes": [[2**20, 0.3, 0.3], [2**24, 40.0, 40.0], [2**28, 45.0, 45.0]],
        }}
        for rank in range(4)
    ]  # fmt: skip
    ranks[3]["bandwidth"]["across nodes"][-1][2] = slowest
    checks = [{"check": "ranks", "status": "PASS", "detail": "4 arrived", "fix": ""}]
    path.write_text(json.dumps({"checks": checks, "ranks": ranks}))
    return path


def test_the_doctors_report_gives_the_slowest_bandwidth_it_measured(tmp_path, capsys):
    """The slowest rank's busbw across nodes at the largest size (not a smaller size's lower figure): the
    same table as --bandwidth with that figure."""
    argv = SMALL + ["--gpus-per-node", "2", "--max-gpus", "4"]
    plan.main(argv + ["--doctor", str(doctor_json(tmp_path / "doctor.json", 11.5))])
    from_doctor = capsys.readouterr().out
    plan.main(argv + ["--bandwidth", "11.5"])
    assert from_doctor == capsys.readouterr().out and "comm. ms/step" in from_doctor
    assert "links of 11.5 GB/s" in from_doctor


def test_a_doctor_on_one_node_times_no_traffic_between_nodes(tmp_path, capsys):
    """A doctor.json of one node holds its links within it alone: the plan timed the two-node rows' traffic by them
    (an NVLink figure for InfiniBand: several times too fast), unsaid. Those cells are `?`, with the way to measure."""
    report = doctor_json(tmp_path / "doctor.json", 11.5)
    one_node = json.loads(report.read_text())
    for rank in one_node["ranks"]:
        del rank["bandwidth"]["across nodes"]
    report.write_text(json.dumps(one_node))
    plan.main(SMALL + ["--gpus-per-node", "2", "--max-gpus", "4", "--doctor", str(report)])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0] + line.split(" | ")[1]: line for line in out.splitlines() if line.startswith("| ")}
    assert rows["| 2DDP"].endswith(" |") and not rows["| 2DDP"].endswith(" ? |")  # within the node: timed
    assert all(rows[f"| 4{name}"].endswith(" ? |") for name in ("DDP", "FSDP", "HSDP")), out
    assert f"?: {report} measured no link between nodes" in out and "or give --bandwidth" in out


@pytest.mark.parametrize(
    "text, named",
    [
        (None, "No such file or directory"),
        ("", "is not JSON, or is cut short"),
        ('{"checks": [{"check": "ranks", "status": "PA', "is not JSON, or is cut short"),
        ("[1, 2]", "is not a doctor's report"),
        ('{"ranks": [{"rank": 0, "bandwidth": {"across nodes": 5}}]}', "is not a doctor's report"),
        ('{"ranks": [{"rank": 0, "bandwidth": {}}]}', "measured no bandwidth"),  # one rank: nothing to reduce
        ("folder", "Is a directory"),
    ],
    ids=["missing", "empty", "cut short", "a list", "another shape", "one rank", "a folder"],
)
def test_a_doctor_file_missing_damaged_or_foreign_is_one_line(tmp_path, text, named):
    path = tmp_path / "doctor.json"
    if text == "folder":
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as stop:
        plan.main(SMALL + ["--doctor", str(path)])
    message = str(stop.value.code)
    assert message.startswith(f"error: --doctor {path}") and named in message and "\n" not in message, message
    assert message.endswith("--bandwidth")  # the fix: the doctor's own file, or the figure by hand


def test_the_host_memory_each_rank_needs(capsys):
    """DDP's stages build the whole model on each rank's CPU; stage 05 one layer at a time (Net's fc1,
    9216 x 128 weights and 128 biases, the largest), and rank 0 gathers it whole for --save-model."""
    plan.main(["--model", "net", "--max-gpus", "2"])
    whole, fc1 = 1199882 * 4 / 2**20, (9216 * 128 + 128) * 4 / 2**20
    assert (
        f"host memory per rank for the weights: DDP {whole:.1f} MiB (the whole model, built on the CPU); "
        f"FSDP and HSDP {fc1:.1f} MiB (its largest layer), rank 0 {whole:.1f} MiB with --save-model"
    ) in capsys.readouterr().out
    model = plan.build(plan.parse([]))  # a task's META = False: stage 05 builds it whole on each rank's CPU
    assert f"FSDP and HSDP {whole:.1f} MiB (META = False: whole)" in plan.host(model, on_meta=False)


@pytest.mark.parametrize("world_size, name, stage", [
    (1, "DDP", "03_ddp_single_node"), (4, "DDP", "03_ddp_single_node"), (8, "DDP", "04_ddp_multi_node"),
    (2, "FSDP", "05_fsdp"), (8, "HSDP", "05_fsdp"),
])  # fmt: skip
def test_the_sbatch_lines_fit_the_job_script_they_name(world_size, name, stage, capsys):
    """Pasted into the job script the plan names, its lines start a rank per GPU: 03's one task is torchrun, which
    starts them (two tasks were two torchruns); 04's and 05's srun starts one per task."""
    plan.recommend(plan.parse(["--gpus-per-node", "4"]), (world_size, name))
    out = capsys.readouterr().out
    assert f"({stage}/job.slurm)" in out
    lines = dict(line.split("=") for line in out.splitlines() if line.startswith("#SBATCH"))
    nodes, tasks, gpus = int(lines["#SBATCH --nodes"]), int(lines["#SBATCH --ntasks-per-node"]), lines["#SBATCH --gres"]
    gpus = int(gpus.split(":")[1])
    script = (REPO / stage / "job.slurm").read_text()
    torchrun = "srun torchrun" in script  # one task a node, which starts --nproc_per_node=$SLURM_GPUS_ON_NODE ranks
    assert nodes * gpus == world_size and tasks == (1 if torchrun else gpus)
