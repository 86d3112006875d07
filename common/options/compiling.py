"""--compile (compiled()): fused kernels; on one GPU, the whole training step, forward, backward
and update, as one CUDA graph; the compiler's seconds in each epoch's row (timed()).

At batch 64 a step of the MNIST Net is some 60 small kernels, each launched from Python: the GPU
waits for the host (2.0 ms a step on an H200; 0.56 ms replayed as one graph, 0.45 ms with compiled
kernels: bench/gpu/step_probe.py). A graph replays the kernels it recorded on the memory it
recorded, so:
- each batch is copied into the recorded input; a batch of another shape (an epoch's last) or
  kind (a dict: text) runs eagerly, as without --compile;
- the optimizer keeps its step count on the GPU while recording (capturable) and the graph holds
  its learning rate as a number: a new rate (the scheduler's, once an epoch) records the step anew;
- recording needs a few eager steps first (cuDNN's choice of kernels, the optimizer's state):
  they are undone, weights, optimizer state and random generator put back in place, so the run
  trains on the batches, and from the state, it would have without.

A graph holds only work on one GPU: not DDP's all-reduce hooks, which fire between the backward's
parts (pytorch/pytorch#128218, #140395), nor DataParallel's thread per GPU, nor --amp's autocast,
whose cache of cast weights outlives a step; stage 05 compiles each FSDP2 unit and records nothing
(its gathers and reduce-scatters run between the units). No step reads a tensor on the host, but on
--log-interval steps. Recording keeps to this thread's CUDA calls (capture_error_mode
"thread_local", as Inductor's own graphs record): a DataLoader's pin-memory thread allocates pinned
memory and queries events meanwhile, which would invalidate a "global" capture.
"""

import contextlib
import time

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from common.distributed import print0

WARM_UP = 3  # eager steps on a side stream before recording, as torch.cuda.graph asks
ENTRIES = 8  # a unit's compiled shapes: training, evaluation, each with its last smaller batch
NO_GRAPHS = {  # what a CUDA graph cannot hold, by the model's wrapper (the module's docstring)
    DistributedDataParallel: "DDP's all-reduce hooks cannot be captured",
    DataParallel: "DataParallel's thread per GPU cannot be captured",
}


def compiled(step, log, args):
    """--compile: torch.compile the model in place (its state dict keeps its names), timed in `log`;
    says once if the step is also one CUDA graph, else why not. Returns the step that runs it."""
    why = next((why for kind, why in NO_GRAPHS.items() if isinstance(step.model, kind)), None)
    why = "--amp's autocast cannot be recorded" if args.amp else why
    why = "CUDA graphs need a GPU" if step.device.type != "cuda" else why
    graph = f"no CUDA graph: {why}" if why else "the step one CUDA graph"
    print0(f"compile: fused kernels, {graph}")
    step.model.compile()
    timed(log, step.model)
    return step if why else step._replace(run=StepGraph(step.run))


def units(units, log):
    """Stage 05's --compile: each FSDP2 unit compiled in place, timed in `log`. No CUDA graph: the
    gathers and reduce-scatters run between the units. The units share one compiled frame, whose
    entries (a unit's shapes, in training or evaluation, a last smaller batch) are then all of the
    units': its limit (8) ran the rest eagerly, unsaid; and a width of another unit made a dimension
    dynamic, which Inductor failed on (WideResNet's blocks): each shape compiled as it is."""
    if not units:
        raise ValueError(
            "--compile compiles stage 05's units, the layers the task's blocks(model) returns: it "
            "returned none: return the layers to shard one at a time, or leave out --compile"
        )
    from torch._dynamo import config  # here: it imports in 1.5 s

    print0("compile: fused kernels per unit, no CUDA graph: the gathers run between the units")
    config.recompile_limit = max(config.recompile_limit, ENTRIES * len(units))
    for unit in units:
        unit.compile(dynamic=False)
    timed(log, units[-1])


def timed(log, model):
    """The compiler's seconds while `model` trains, into log.compiled: each epoch's row counts its
    own, the backward's included (compiled with grad off); an evaluation's (in eval mode) count
    nowhere (torch._dynamo imports in 1.5 s: only under --compile)."""
    from torch._dynamo import callback

    def started(*_):
        if model.training:
            log.compiled -= time.perf_counter()

    def ended(*_):
        if model.training:  # as at its start: one call, one mode
            log.compiled += time.perf_counter()

    callback.on_compile_start(started)
    callback.on_compile_end(ended)


class StepGraph:
    """`eager(step, x, y)` recorded for the loader's batch shape and the learning rates it holds"""

    shape = rates = graph = x = y = loss = None  # until the first batch

    def __init__(self, eager):
        self.eager = eager

    def __call__(self, step, x, y):
        shape = (x.shape, y.shape) if torch.is_tensor(x) and torch.is_tensor(y) else None
        self.shape = self.shape or shape  # the first batch's: the loader's batch size
        if shape is None or shape != self.shape:  # a text batch (a dict), an epoch's last batch
            return self.eager(step, x, y)
        if [group["lr"] for group in step.optimizer.param_groups] != self.rates:  # a new rate
            if self.rates is None:
                warm_up(self.eager, step, x, y)
            self.record(step, x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.loss

    def record(self, step, x, y):
        self.rates = [group["lr"] for group in step.optimizer.param_groups]  # held as numbers
        self.x, self.y = x.clone(), y.clone()
        self.graph = torch.cuda.CUDAGraph()  # the last one's memory goes back
        step.optimizer.zero_grad(set_to_none=True)  # the graph writes the gradients, not adds
        # this thread's calls alone: a pin-memory thread's would invalidate a "global" capture
        recording = torch.cuda.graph(self.graph, capture_error_mode="thread_local")
        with capturable(step.optimizer), recording:
            self.loss = self.eager(step, self.x, self.y)


@contextlib.contextmanager
def capturable(optimizer):
    """No host read of step counts while it lasts; a checkpoint's optimizer stays an eager run's."""
    groups = [group for group in optimizer.param_groups if "capturable" in group]
    for group in groups:
        group["capturable"] = True
    yield
    for group in groups:
        group["capturable"] = False


def state(step):
    """What a step changes: weights, buffers (BatchNorm's statistics), the optimizer's state."""
    optimizer = [t for s in step.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return [*step.model.parameters(), *step.model.buffers(), *optimizer]


@contextlib.contextmanager
def undone(step):
    """Weights, buffers, optimizer state (new state at zero) and generator put back in place."""
    before = {id(t): t.clone() for t in state(step)}
    with torch.random.fork_rng([step.device] if step.device.type == "cuda" else []):
        yield
    with torch.no_grad():
        for t in state(step):
            t.copy_(before[id(t)]) if id(t) in before else t.zero_()


def warm_up(train_step, step, x, y):
    """WARM_UP eager steps (cuDNN's choice of kernels, the optimizer's state), then undone."""
    for s in step.optimizer.state.values():  # a resumed optimizer's step counts, on the CPU
        s.update({k: v.to(step.device) for k, v in s.items() if k == "step"})
    side, now = torch.cuda.Stream(step.device), torch.cuda.current_stream(step.device)
    with undone(step):  # copies on the current stream, before and after the side stream's steps
        side.wait_stream(now)
        with capturable(step.optimizer), torch.cuda.stream(side):
            for _ in range(WARM_UP):
                step.optimizer.zero_grad(set_to_none=True)
                train_step(step, x, y)
        now.wait_stream(side)
