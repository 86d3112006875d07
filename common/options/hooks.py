"""A task's hooks beyond model() and datasets() (common/tasks/README.md), read where a task defines
them: its own metric and score(), or totals() and figure(), or its loss() as its figure (metric());
its collate() is the loaders' (loaders.py)."""

import torch
import torch.distributed as dist

from common.checkpoint import unwrap
from common.data import count
from common.metrics import Metric
from common.options import large, recipes

OWN = {"metric", "loss", "throughput"}  # a task defining one is measured here
ACCURACY = ("accuracy", "higher")  # the stages' own: the mean of each sample's share right, in %


def metric(task, args):
    """The task's `metric = ("mae", "lower")` with score(output, target), a value per sample, summed
    here: the epoch lines, metrics.csv (test_mae), --target and the tools follow it. A task with a
    loss() and no metric of its own: its mean loss, lower is better, never an accuracy. Its
    throughput(args), e.g. ("tokens", args.seq_len): what each sample counts, the speed's unit."""
    unit = throughput(task.throughput(args)) if hasattr(task, "throughput") else ("samples", 1)
    own = getattr(task, "metric", None)
    if own and own[0] == "accuracy" and (own != ACCURACY or hasattr(task, "totals")):
        raise ValueError(
            f"the task's metric {own} is not the stages' accuracy, the mean of each sample's share "
            f"right (score()), higher is better, in %: name it after what it is, e.g. "
            f'("token_accuracy", "higher") or ("error", "lower")'
        )
    if hasattr(task, "totals"):
        return Totals(*task.metric, task.totals, task.figure, unit)
    if hasattr(task, "metric"):
        return Mean(*task.metric, lambda out, y: per_sample(task.score(out, y), count(y)), unit)
    if hasattr(task, "loss"):
        return Metric("mean_loss", "lower", lambda output, y: task.loss(output, y) * count(y), unit)
    return Metric(unit=unit)


def throughput(unit):
    """(name, count per sample) as the task's throughput(args) returns it, or one line."""
    name, per_sample = unit if isinstance(unit, tuple) and len(unit) == 2 else (None, None)
    if not (isinstance(name, str) and type(per_sample) is int and per_sample > 0):  # no bool
        raise ValueError(
            f"the task's throughput(args) must return (unit, count per sample), e.g. "
            f'("tokens", args.seq_len), not {unit!r}: the epoch line\'s speed in that unit'
        )
    return unit


def per_sample(scores, samples):
    """The sum of score()'s values, one per sample: a sum or a mean the stages would misread."""
    if not (torch.is_tensor(scores) and tuple(scores.shape) == (samples,)):
        got = tuple(scores.shape) if torch.is_tensor(scores) else type(scores).__name__
        raise ValueError(
            f"the task's score(output, target) must return one value per sample, of shape "
            f"({samples},) for this batch, not {got}: the stages sum it and divide by the samples"
        )
    return scores.sum()


class Mean(Metric):
    """A task's score(), one value per sample: their mean. An accuracy's, each sample's share right,
    in % as the stages' own; beyond 100 % it was a percentage or a count, which --target and the
    tools would misread (a target of 99 reached at 5609 %): one line."""

    def value(self, row, samples):
        value = super().value(row, samples)
        if self.name == "accuracy" and (value < 0 or value > 100):  # nan: logged as any metric's
            raise ValueError(
                f"the task's accuracy came to {value:.6g}%: its score() must give each sample's "
                f"share right, from 0 to 1 (the stages show their mean in %), not a percentage"
            )
        return value


class Totals:
    """A task's metric of sums over the whole epoch: totals(output, target), a row of K sums over
    the rank's samples of a batch (true and false positives, intersections and unions, a summed
    loss and its tokens), summed over the epoch and the ranks as score() is; figure(totals) of
    them, e.g. micro-F1 (a mean over samples cannot give it). The row's length is the first
    batch's, held here: another later would be summed into the wrong totals."""

    def __init__(self, name, better, totals, figure, unit=("samples", 1)):
        self.name, self.better, self.unit = name, better, unit
        self.totals, self.figure = totals, figure
        self.width = 0  # the row's length, once the first batch's is known

    def score(self, output, target):
        sums = self.totals(output, target)
        row = torch.is_tensor(sums) and sums.is_floating_point() and sums.ndim == 1
        self.width = self.width or (len(sums) if row else 0)
        if not (row and len(sums) == self.width):
            tensor = torch.is_tensor(sums)
            got = f"{sums.dtype} of shape {tuple(sums.shape)}" if tensor else type(sums).__name__
            raise ValueError(
                f"the task's totals(output, target) must return a 1-D float tensor of one length "
                f"every batch (the first's: {self.width or 'none'}), not a {got}"
            )
        return sums

    def value(self, sums, samples):
        figure = torch.as_tensor(self.figure(torch.tensor(sums, dtype=torch.float64)))
        if figure.numel() != 1 or not figure.isfinite().all():  # logged and saved, then "damaged"
            raise ValueError(
                f"the task's figure(totals) must be one finite number, not {figure.tolist()} (of "
                f"the epoch's totals {sums}): a class with no sample is 0/0 (torch.nanmean leaves "
                "it out)"
            )
        return float(figure)


RECIPE = {"optimizer", "scheduler", "weights"}  # a task's own, or a flag's (flags.LESSON): recipe()


def recipe(step, states, task, args):
    """The flags' optimizer and schedule (--optimizer, --scheduler...: recipes.py), or the task's
    own recipe (common/tasks/README.md): its weights(args) to start from, its optimizer(args,
    model), its scheduler(args, optimizer), stepped after every optimizer step, and --clip-grad,
    before each step (after --amp's unscaling; stage 05's sharded gradients as they are); stage
    05's --grad-accum too. Returns the step, and the scheduler the stage steps at each epoch's
    end."""
    optimizer = recipes.optimizer(args, step.model.parameters())  # the flags', for the lesson's
    states.update(optimizer=optimizer, scheduler=recipes.scheduler(args, optimizer))
    step = step._replace(optimizer=optimizer)
    path = getattr(task, "weights", None) and task.weights(args)
    fresh = kept_fresh(task)
    if path:  # over the initialised model: a tensor the file lacks keeps its start, as in stage 01
        load_weights(step.model, path, fresh)
    if getattr(args, "grad_accum", 1) > 1:
        step = large.accumulating(step, args.grad_accum)
    if not (args.clip_grad or {"optimizer", "scheduler"} & vars(task).keys()):
        return step, states["scheduler"]
    noted, read = recipes.noting(args)  # the flags the task's optimizer() and scheduler() read
    optimizer = task.optimizer(noted, unwrap(step.model)) if hasattr(task, "optimizer") else None
    optimizer = owned(optimizer, step.model) if optimizer else step.optimizer
    if hasattr(task, "scheduler"):
        inner, per_step = task.scheduler(noted, optimizer), True
    elif optimizer is not step.optimizer:
        inner, per_step = recipes.scheduler(args, optimizer), False  # the flags', per epoch
    else:
        inner, per_step = states["scheduler"], False
    # the stage's flags the task's recipe replaces and never reads: its manifest records none
    unused = [*recipes.OPTIMIZER] if optimizer is not step.optimizer else []
    unused += [*recipes.SCHEDULER] if per_step else []
    read = read if "__dict__" not in read else set(unused)  # vars(args): it may read any of them
    unused = [flag for flag in unused if flag not in read]
    schedule = Schedule(optimizer, inner, per_step, args.clip_grad, unused)
    states.update(optimizer=optimizer, scheduler=schedule)
    return step._replace(optimizer=optimizer), schedule


def owned(optimizer, model):
    """The task's optimizer(), over the model's own parameters: one over a new model(args)'s stepped
    those, and the run trained nothing, untold; a tensor outside the model is neither saved with it
    nor kept alike on every rank."""
    mine = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if strays := sum(id(p) not in mine for p in held):
        raise ValueError(
            f"the task's optimizer(args, model) holds {strays} of its {len(held)} tensors outside "
            f"the model it is given: build it over that model's parameters, as "
            f"AdamW(model.parameters())"
        )
    return optimizer


class Schedule:
    """The scheduler the stage steps once an epoch: the stage's own, or the task's, stepped after
    every optimizer step instead. The rate the optimizer used last (the epoch line, metrics.csv);
    what defines the recipe, saved with it: a resume with another optimizer or schedule is refused.
    """

    def __init__(self, optimizer, inner, per_step, clip, unused=()):
        self.optimizer, self.inner, self.per_step, self.clip = optimizer, inner, per_step, clip
        self.unused = unused  # the stage's flags the recipe replaces
        self.used = [group["lr"] for group in optimizer.param_groups]
        optimizer.register_step_pre_hook(self.before)
        if per_step:
            optimizer.register_step_post_hook(lambda *_: inner.step())

    def before(self, optimizer, *_):
        if self.clip:  # GradScaler calls step() after unscaling, and not at all after an inf
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        self.used = [group["lr"] for group in optimizer.param_groups]

    def step(self):
        if not self.per_step:
            self.inner.step()

    def get_last_lr(self):
        return self.used if self.per_step else self.inner.get_last_lr()

    def recipe(self):
        """The optimizer's and scheduler's classes and settings, the rates aside."""
        groups = [
            {k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
            for g in self.optimizer.param_groups
        ]
        sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        kind = "per step" if self.per_step else "per epoch"
        return (
            f"{type(self.optimizer).__name__} {groups} of {sizes} tensors, "
            f"{type(self.inner).__name__} {kind}"
        )

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "used": self.used, "recipe": self.recipe()}

    def load_state_dict(self, state):
        if state.get("recipe") != self.recipe():
            raise ValueError(
                f"the checkpoint was trained with {state.get('recipe', 'the stage optimizer')}, "
                f"this run defines {self.recipe()}: resume with the same optimizer(), scheduler()"
            )
        self.inner.load_state_dict(state["inner"])
        self.used = state["used"]


def kept_fresh(task):
    """The task's FRESH, the first letters of the keys of weights(args)'s file left at their start:
    a tuple or list of them, or one string (its letters were each one: "c" left conv1 too)."""
    named = getattr(task, "FRESH", ())
    return (named,) if isinstance(named, str) else tuple(named)


def load_weights(model, path, fresh):
    """weights(args)'s file into the model, but its keys that start with one of `fresh` (a new
    head), left as initialised: on each rank (stages 01-04), or mapped by rank 0 alone, each rank
    receiving its shards (stage 05)."""
    from torch.distributed.checkpoint import state_dict as sd

    sharded = any(hasattr(t, "to_local") for t in model.state_dict().values())
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    whole = torch.load(path, "cpu", mmap=True, weights_only=True) if rank0 or not sharded else {}
    whole = {k: v for k, v in whole.items() if not k.startswith(fresh)}
    if sharded and dist.is_initialized():
        options = sd.StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=not fresh
        )
        sd.set_model_state_dict(model, whole, options=options)
    else:
        unwrap(model).load_state_dict(whole, strict=not fresh)
