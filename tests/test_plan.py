"""tools/plan.py: its state figures are the bytes real FSDP and HSDP runs hold, its activations what a real
training step saves, and its answer a job script's #SBATCH lines."""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import REPO, free_port, run
from test_equivalence import ARGS, CPU, RUN, stage
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import amp, models, optim

sys.path.insert(0, str(REPO / "tools"))
import plan  # noqa: E402

SMALL = ["--model", "wideresnet", "--depth", "10", "--width", "1", "--dataset", "cifar10", "--batch-size", "8"]
MESHES = {1: None, 2: (2,), 4: (4,), "2x2": (2, 2)}  # world size or "nodes x ranks": the mesh of stage 05


def local_bytes(tensors):
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors if t.dim())


def held(rank, world_size, port, shape, result):
    """Rank 0's bytes of weights, gradients and optimizer state in stage 05's sharding on `shape`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
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
    found = [local_bytes(model.parameters()), local_bytes(p.grad for p in model.parameters()),
             local_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]  # fmt: skip
    if rank == 0:
        torch.save(found, result)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("size", list(MESHES))
def test_the_plans_state_is_what_fsdp_and_hsdp_hold(size, tmp_path):
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
        mp.spawn(held, args=(world_size, free_port(), MESHES[size], tmp_path / "b.pt"), nprocs=world_size)
        found = torch.load(tmp_path / "b.pt", weights_only=True)
    assert found == [planned["weights"], planned["gradients"], planned["optimizer"]]


def test_the_plans_activations_are_what_a_training_step_saves(tiny_data):
    """Stage 01's train() at a batch of 8, its saved tensors counted by the same hooks: the plan's figure,
    which it extrapolated from batches of 1 and 2."""
    args = plan.parse(["--batch-size", "8", "--optimizer", "adadelta"])
    planned = plan.per_gpu(args, 1, plan.measure(args))["DDP"]["activations"]
    model = plan.build(args)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    batch = [(torch.randn(8, 1, 28, 28), torch.randint(10, (8,)))]
    optimizer = torch.optim.Adadelta(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage("01_single_gpu").train(model, CPU, batch, optimizer, amp.scaler(CPU, ARGS), 1, ARGS, RUN)
    assert sum(saved.values()) == planned > 0


def test_the_plan_answers_with_sbatch_lines_in_seconds():
    out = run([sys.executable, REPO / "tools/plan.py", "--model", "wideresnet", "--depth", "16", "--width", "4",
               "--dataset", "cifar10", "--batch-size", "4096", "--gpu-memory", "4", "--gpus-per-node", "4",
               "--bandwidth", "23"], timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "| 8 | HSDP |" in out.stdout and "comm. ms/step" in out.stdout
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in lines
        if line[:3] == "| " + line[2:3] and line[2].isdigit()
    ]
    fitting = sorted(int(row[0]) for row in rows if row[9] == "yes")
    nodes, tasks, gres = (int(line.split("=")[1].split(":")[-1]) for line in lines if line.startswith("#SBATCH"))
    assert fitting and nodes * tasks == fitting[0] and gres == tasks  # the smallest that fits, nothing smaller
