"""--compile's CUDA graph of the whole step (common/compiling.py): what a CPU can show. The eager steps that
recording needs first leave no trace (the run trains from the state, and draws the dropout masks, it would
have without), and a checkpoint's optimizer stays an eager run's. Recording and replay need a GPU:
bench/gpu/measure.sh's speedup rows train stage 01 eager and with --compile side by side."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, S01, metrics, python, stage_args
from test_equivalence import CPU, model_without_dropout

from common import optim
from common.models import Net
from common.options import compiling

OPTIMIZERS = {
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),  # its momentum buffer: a first step's grad
}


def train_step(step, x, y):
    loss = step.loss_fn(step.model(x), y)
    loss.backward()
    step.optimizer.step()
    return loss.detach()


def make(kind):
    torch.manual_seed(0)
    model = Net()  # with dropout: the generator must be put back too
    return optim.Step(model, CPU, OPTIMIZERS[kind](model.parameters()), F.nll_loss, None, train_step)


def steps(step, batch, n):
    for _ in range(n):
        step.optimizer.zero_grad(set_to_none=True)
        train_step(step, *batch)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_the_steps_before_recording_are_undone(kind, resumed):
    """Inside compiling.undone(), three steps; after it, the same tensors (recording keeps their memory) with the
    same values, the optimizer's new state at zero, and the next steps bit-identical to a run without them."""
    batch = (torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    step = make(kind)
    if resumed:  # an optimizer with state, as after a checkpoint's restore
        steps(step, batch, 2)
    twin = copy.deepcopy(step)  # the run without the extra steps
    torch.manual_seed(1)
    held = compiling.state(step)
    with compiling.undone(step):
        steps(step, batch, 3)
        assert not torch.equal(step.model.fc2.weight, twin.model.fc2.weight)  # they trained
    after = compiling.state(step)
    assert all(any(t is h for t in after) for h in held)  # in place: a graph's recorded memory
    for t in after[len(held) :]:  # what the steps created: zero, as a first step finds it
        assert not t.any()
    steps(step, batch, 2)  # from the generator as it was before undone(): the same dropout masks
    generator = torch.get_rng_state()
    torch.manual_seed(1)
    steps(twin, batch, 2)
    for mine, theirs in zip(step.model.state_dict().values(), twin.model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(generator, torch.get_rng_state())


def test_capturable_only_while_recording():
    """The optimizer is capturable (its state on the GPU, no host read of its step count) inside the
    context only: its param_groups, and so a checkpoint, are an eager run's after it; SGD gains no key."""
    model = torch.nn.Linear(2, 2)
    for optimizer in (torch.optim.Adadelta(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)):
        before = copy.deepcopy(optimizer.state_dict()["param_groups"])
        inside = True if isinstance(optimizer, torch.optim.Adadelta) else None  # SGD: no step count
        with compiling.capturable(optimizer):
            assert [group.get("capturable") for group in optimizer.param_groups] == [inside]
        assert optimizer.state_dict()["param_groups"] == before


def test_a_batch_of_another_shape_runs_eagerly():
    """Only the loader's batch shape (the first seen) is recorded: an epoch's last, smaller batch steps
    eagerly, on a CPU as on a GPU (recording the first batch needs a GPU: here it is taken as recorded)."""
    step, batch = make("adadelta"), (torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    ran = []
    graph = compiling.StepGraph(lambda *a: ran.append(a) or train_step(*a))
    graph.shape = [torch.Size([16, 1, 28, 28]), torch.Size([16])]
    loss = graph(step, *batch)
    assert len(ran) == 1 and ran[0][1] is batch[0] and graph.graph is None and loss.ndim == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="recording a CUDA graph needs a GPU")
def test_recorded_steps_train_as_eager_steps():
    """On a GPU: two epochs of five full batches and a short one, the learning rate changed between them
    (recorded anew), the short batches eager: the weights of eager training, within float tolerance."""
    gpu = torch.device("cuda")
    torch.manual_seed(0)
    epochs = [[(torch.randn(n, 1, 28, 28, device=gpu), torch.randint(0, 10, (n,), device=gpu)) for n in
               [16] * 5 + [8]] for _ in range(2)]  # fmt: skip
    weights = []
    for graph in (None, compiling.StepGraph(train_step)):
        model = model_without_dropout().to(gpu)
        optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        step = optim.Step(model, gpu, optimizer, F.nll_loss, None, graph or train_step)
        losses = []
        for batches in epochs:
            for x, y in batches:
                optimizer.zero_grad(set_to_none=True)
                losses.append(step.run(step, x, y).clone())
            scheduler.step()
        weights.append((torch.stack(losses), model.state_dict()))
    (eager_losses, eager), (recorded_losses, recorded) = weights
    torch.testing.assert_close(recorded_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for key, value in eager.items():
        torch.testing.assert_close(recorded[key], value, rtol=1e-4, atol=1e-5)


def test_a_batch_that_is_not_two_tensors_runs_eagerly():
    """A task's batch of dicts (text: token ids and a mask) is never recorded: each steps eagerly, with no GPU
    touched, whatever its shapes."""
    step, ran = make("adadelta"), []
    graph = compiling.StepGraph(lambda s, x, y: ran.append(x) or train_step(s, x["image"], y))
    x = {"image": torch.randn(8, 1, 28, 28)}
    loss = graph(step, x, torch.randint(0, 10, (8,)))
    assert ran == [x] and graph.graph is None and graph.shape is None and loss.ndim == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="recording a CUDA graph needs a GPU")
def test_a_step_recorded_beside_workers_and_a_pin_memory_thread_trains_as_eager(tmp_path):
    """--compile --loader classic --num-workers 4 on a GPU: the pin-memory thread allocates pinned memory and
    queries events while each epoch's step is recorded (a new rate each epoch), which a "global" capture refuses;
    recorded with capture_error_mode="thread_local", three epochs train as eager ones do. Dropout draws other masks
    compiled, so the runs compare by what they reach, not weight by weight."""
    rows = {}
    for name, extra in (("eager", []), ("recorded", ["--compile"])):
        args = stage_args(REPO / "data", tmp_path / name, "--epochs", 3, "--limit", 8192, "--loader", "classic")
        out = python(S01, *args, "--num-workers", 4, *extra, CUDA_VISIBLE_DEVICES="0", timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        rows[name] = metrics(tmp_path / name)
    assert "the step one CUDA graph" in out.stdout and len(rows["recorded"]) == 3
    eager, recorded = (float(rows[name][-1]["test_accuracy"]) for name in ("eager", "recorded"))
    assert eager > 90 and abs(recorded - eager) < 1.5, (eager, recorded)
