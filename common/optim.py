"""pytorch/examples' optimizer and learning-rate schedule, Adadelta at --lr and StepLR by --gamma
each epoch (another optimizer or schedule, the learning-rate rule for large global batches:
common/options/recipes.py); what the weights, gradients and optimizer state take per rank (stage
05's memory line)."""

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from common.distributed import print0


def optimizer(args, parameters, kind=torch.optim.Adadelta, **settings):
    """Adadelta at --lr (or `kind` with its `settings`: --optimizer's). Sharded weights (DTensors)
    step by foreach, as on GPUs: a loop dispatches each in Python."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    parameters = list(parameters)
    foreach = any(isinstance(p, dtensor) for p in parameters) or None  # None: torch's default
    return kind(parameters, **{"lr": args.lr, "foreach": foreach} | settings)


def state_tensors(args):
    """How many tensors the size of the weights the optimizer keeps: Adadelta and Adam two (running
    averages), RMSprop one, SGD none; momentum one more (stage 05's memory line)."""
    momentum = args.optimizer in ("rmsprop", "sgd") and args.momentum > 0
    return {"adadelta": 2, "adam": 2, "rmsprop": 1, "sgd": 0}[args.optimizer] + int(momentum)


def memory(model, args, world_size, mesh):
    """Stage 05, at start: the mesh; what each rank holds of weights, gradients and optimizer state
    under DDP (all), FSDP (1/world size) and HSDP (1/ranks per node); activations come on top."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    total = weights * (2 + state_tensors(args))
    shards = mesh.shape[-1] if mesh is not None else 1  # the ranks sharing one copy of the weights
    if mesh is not None and mesh.ndim == 2:
        print0(
            f"mesh: {mesh.shape[0]} nodes (replicate) x {mesh.shape[1]} ranks (shard): HSDP, "
            "weights gathered within a node, gradients all-reduced across nodes"
        )
    elif mesh is not None:
        print0(f"mesh: {shards} ranks (shard): FSDP across all of them")
    peak = "each epoch's, in the log" if torch.cuda.is_initialized() else "not measured on the CPU"
    print0(
        f"memory per rank: weights {weights:.1f} MiB + gradients {weights:.1f} MiB + "
        f"{args.optimizer} state {total - 2 * weights:.1f} MiB = {total:.1f} MiB under DDP, "
        f"{total / world_size:.1f} MiB under FSDP at world size {world_size}, "
        f"{total / shards:.1f} MiB with this mesh | peak device memory: {peak}"
    )


def scheduler(args, optimizer):
    """The rate times --gamma after every epoch, stepped once per epoch."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)


class Step(NamedTuple):
    """What a training step and an evaluation use: the stages' train() and evaluate() take it."""

    model: torch.nn.Module
    device: torch.device
    optimizer: torch.optim.Optimizer
    loss_fn: Callable  # the task's loss(output, target)
    score: Callable  # the task's metric summed over a batch (metrics.Metric)
    run: Callable  # run(step, x, y): the stage's train_step, or an option's (--amp, --compile)
