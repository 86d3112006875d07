"""Guard rail: a resume is the same run only if everything that defines it is what the run recorded, and its
checkpoint holds what this run declares. Recorded in the run's manifest and compared (mismatch()): the options that
change the numbers (options.DEFINING, --grad-accum among them), the task file by what it holds (its hash,
preflight.defining()), the training and test data (their fingerprints); the world size, which changes the numbers but not the
samples, is said in one line before the first step (say_world()). A checkpoint's own values are checked against what
the model and the options declare (check_values()) before anything of it is restored: its parts present, each tensor
of the model of the model's dtype and shape (stage 05's as its .metadata lists them: DCP casts what it loads), an
epoch and a step in range, the metrics' rows and the schedule's steps of the epochs done, random generators that can
be put back, the optimizer's settings of this run's kinds; each a one-line refusal."""

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint import SPLIT, unwrap
from common.distributed import print0
from common.guards import options, randomness
from common.guards.check import usage
from common.guards.preflight import defining, same

ANOTHER = "resume from another checkpoint, or with the model and --optimizer it was trained with"


class Stamp:
    """Whose a checkpoint is, one of the states it holds ("run"): the id and the record of the run that wrote it,
    from its folder's manifest (rank 0's, which alone saves). A checkpoint copied into another run's folder says
    that it is another run's, and one copied away alone what defines it (resume.find())."""

    def __init__(self, manifest):
        self.saved = manifest and {"id": manifest["run"], "record": manifest["record"]}

    def state_dict(self):
        return self.saved

    def load_state_dict(self, saved):  # compared before anything is restored: nothing to put back
        pass


def record(args, states, fingerprints):
    """What defines the run, for its manifest (ownership.claim()) and each checkpoint's Stamp: the options that
    change the numbers, the data's `fingerprints` (preflight.fingerprint()), the model's size, the world size, the
    stage, and a task's own recipe (optimizer(), scheduler()), whose flags it never reads are recorded as none."""
    parameters = sum(p.numel() for p in states["model"].parameters())  # a sharded one's: its global shape
    world = dist.get_world_size() if dist.is_initialized() else 1  # changes the numbers, not the samples
    mesh = getattr(next(states["model"].parameters(), None), "device_mesh", None)  # stage 05's, its shape too
    run = {"flags": defining(args), **fingerprints, "parameters": parameters, "world": world}
    run["mesh"] = list(mesh.shape) if mesh is not None else None
    run["stage"] = Path(sys.argv[0]).resolve().parent.name  # the tools compare runs of any --output-dir
    if hasattr(states["scheduler"], "recipe"):  # a task's optimizer() or scheduler(), not --optimizer's
        run["recipe"] = states["scheduler"].recipe()
        unused = getattr(states["scheduler"], "unused", ())  # its flags: recorded as none, never compared
        if problem := options.replaced(unused, sys.argv[1:]) or options.unset_task_rate(
            states["optimizer"], args, sys.argv[1:]
        ):
            usage(problem)
        run["flags"] = {k: v for k, v in run["flags"].items() if k not in unused}
    return run


def differs(run, args, fingerprints, verb="resume"):
    """Why the options, task or data this run was given are not those the manifest's `run` records, or None.
    `fingerprints`: {"data": the training set's, "test": the test set's} (preflight.fingerprint()), as recorded."""
    now, flags = defining(args), options.used(run.get("flags", {}))  # recorded before an unread value was dropped
    if "(sha256 " not in str(flags.get("task", "(sha256 ")):  # recorded before the task's content was: its name
        now["task"] = args.task.name
    now |= {k: getattr(args, k, None) for k in flags.keys() - now.keys()}  # not defining now: its value (--epochs)
    differ = [f"--{k.replace('_', '-')} {v} (now {now[k]})" for k, v in flags.items() if not same(now[k], v)]
    if differ:
        return f"was written with {', '.join(differ)}: {verb} with the same options, or use another --output-dir"
    for key, split in (("data", "training"), ("test", "test")):  # <samples>-<hash>; a --val-fraction: of training
        if key in fingerprints and run.get(key, fingerprints[key]) != fingerprints[key]:  # none recorded: before it was
            return (
                f"was trained on other data: its {split} set was {run[key]}, here {fingerprints[key]} in --data-dir "
                f"{args.data_dir}: {verb} on the data it was trained on, or use another --output-dir"
            )
    return None


def mismatch(run, state, args, fingerprints, verb="resume"):
    """Why this run cannot continue the one a checkpoint's `state` holds, or None. `run`: what the manifest of
    its folder records of it (a checkpoint of an older version: what it holds itself). A run from before an
    option (or the data's fingerprint) was recorded does not record it: what it records must match."""
    if problem := differs(run, args, fingerprints, verb):
        return problem
    epoch, step = state["epoch"], state["step"]
    if args.epochs < epoch:  # "done", and --save-model would export more epochs than asked for, or a part of one
        return (
            f"holds epoch {epoch}{f', step {step}' if step else ''}, past --epochs {args.epochs}: nothing to "
            f"do; give --epochs {epoch if step else epoch + 1} or more to continue it"
        )
    return None


def declared(states, sharded, train_size, args):
    """What a checkpoint of this run holds: the parts of `states` (stage 05's model and optimizer are in its
    shards), the model's tensors as (dtype, shape) by name (a whole checkpoint's, or what a sharded one's .metadata
    lists: shards_differ()), and the most steps an epoch has."""
    parts = [name for name in states if not (sharded and name in SPLIT)]
    model = unwrap(states["model"]).state_dict()  # stage 05's: DTensors, of the whole model's shapes
    tensors = {name: (str(t.dtype), tuple(t.shape)) for name, t in model.items()}
    steps = math.inf if train_size is None else 1 if args.dry_run else math.ceil(train_size / args.batch_size)
    groups = [] if sharded or states.get("optimizer") is None else states["optimizer"].param_groups
    shapes = [tuple(p.shape) for group in groups for p in group["params"]]  # in the order its state numbers them
    settings = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}  # lr, rho...: their kinds
    counted = isinstance(states.get("scheduler"), torch.optim.lr_scheduler.LRScheduler)  # the stage's: per epoch
    shapes = shapes or None
    return dict(parts=parts, tensors=tensors, steps=steps, shapes=shapes, settings=settings, counted=counted)


def check_values(state, declared=None):
    """Why the checkpoint's `state` is not one this run wrote, or None: an epoch from 1, a step from 0 to the steps
    of an epoch, the parts this run restores, the model's tensors of its dtypes and shapes."""
    epoch, step = state.get("epoch"), state.get("step", 0)
    if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 1):
        return f"holds epoch {epoch!r}, which no run saves (its epochs count from 1): resume from another checkpoint"
    steps = declared["steps"] if declared else math.inf
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= steps):
        return (
            f"holds step {step!r} of epoch {epoch}, where an epoch of this run has {steps} steps: it is not this "
            "run's (another --batch-size, --limit or data?): resume from another checkpoint"
        )
    if declared is None:
        return None
    if missing := [name for name in declared["parts"] if not isinstance(state.get(name), dict)]:
        return f"lacks its {', '.join(missing)} (or holds no state there): resume from another checkpoint"
    if (optimizer := state.get("optimizer")) is not None and not {"state", "param_groups"} <= optimizer.keys():
        return "holds an optimizer state without its state and param_groups: resume from another checkpoint"
    if problem := progress_differs(state, declared, epoch if not step else epoch - 1):
        return problem
    if "rng" in declared["parts"] and (why := randomness.unfit(state["rng"])):
        return f"holds random generators that cannot be put back ({why}): resume from another checkpoint"
    if optimizer is not None and (problem := settings_differ(optimizer["param_groups"], declared["settings"])):
        return problem
    if state.get("shards") is not None:  # stage 05: what its .metadata lists, before any rank reads a shard
        return shards_differ(state["shards"], declared["tensors"])
    return model_differs(state.get("model"), declared["tensors"]) or optimizer_differs(optimizer, declared["shapes"])


def progress_differs(state, declared, done):
    """Why the metrics' rows or the schedule's steps a checkpoint holds are not those of its `done` epochs (those
    whose row and schedule step are in: a checkpoint part-way through an epoch has the ones before), or None."""
    if "log" in declared["parts"]:
        rows = state["log"].get("rows")
        epochs = [row.get("epoch") for row in rows if isinstance(row, dict)] if isinstance(rows, list) else rows
        if epochs != list(range(1, done + 1)):
            return f"holds metrics of epochs {epochs!r:.60} for {done} epochs done: resume from another checkpoint"
    if declared["counted"] and (steps := state["scheduler"].get("last_epoch")) != done:
        return f"holds a schedule stepped {steps!r} times for {done} epochs done: resume from another checkpoint"
    return None


def settings_differ(groups, settings):
    """Why an optimizer's saved param `groups` hold a setting unlike this run's (`settings`: a number, a finite one,
    where this run's is one), or None: a NaN learning rate would be blamed on a divergence, a string on train.py."""
    for i, group in enumerate(groups if isinstance(groups, list) else [groups]):
        for key, own in settings.items():
            value = group.get(key, own) if isinstance(group, dict) else None
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if isinstance(own, int | float) and not isinstance(own, bool) and not number:
                return (
                    f"holds the optimizer's {key} {value!r:.40} (param group {i}) where this run's is a finite "
                    f"number: resume from another checkpoint"
                )
    return None


def model_differs(saved, tensors):
    """Why the checkpoint's model `saved` does not fit the model's `tensors` ({name: (dtype, shape)}), or None."""
    for name in sorted(set(tensors) | set(saved)):
        found = saved.get(name)
        found = (str(found.dtype), tuple(found.shape)) if hasattr(found, "dtype") else found
        if found != tensors.get(name):
            return (
                f"does not match this model: its {name} is {shown(found)}, the model's {shown(tensors.get(name))}: "
                "resume with the model (and --task) it was trained with"
            )
    return None


def shards_differ(listed, tensors):
    """Why the tensors a sharded checkpoint lists (`listed`, {name: (dtype, shape)}: safeload.tensors()) do not fit
    the model's `tensors`, or None: its model's as model_differs() checks a whole one's (DCP would load each cast to
    the model's dtype), each of the optimizer's states (but a count, as Adam's step) a float of its parameter's."""
    saved = {name.removeprefix("model."): found for name, found in listed.items() if name.startswith("model.")}
    if problem := model_differs(saved, tensors):
        return problem
    for name, (dtype, shape) in sorted(listed.items()):
        parameter, _, key = name.removeprefix("optimizer.").rpartition(".")
        if not name.startswith("optimizer.") or math.prod(shape) <= 1:
            continue
        if parameter not in tensors or shape != tensors[parameter][1] or "float" not in dtype:
            return (
                f"holds the optimizer's {key} of {parameter} as {shown((dtype, shape))}, the model's {parameter} "
                f"being {shown(tensors.get(parameter))}: {ANOTHER}"
            )
    return None


def optimizer_differs(saved, shapes):
    """Why the optimizer state `saved` does not fit this run's parameters (their `shapes`, in order), or None: as
    many parameters, and each tensor of a parameter's state (but a count, as Adam's step) of its shape, in floats."""
    if saved is None or shapes is None:  # stage 05: in its shards (shards_differ())
        return None
    groups = saved["param_groups"] if isinstance(saved["param_groups"], list) else [None]
    count = sum(len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else -1 for g in groups)
    if count != len(shapes) or not isinstance(saved["state"], dict):
        return f"holds the optimizer state of {count} parameters, this model has {len(shapes)}: {ANOTHER}"
    for index, values in saved["state"].items():
        if not (isinstance(index, int) and 0 <= index < len(shapes) and isinstance(values, dict)):
            return f"holds an optimizer state for a parameter {index!r} this model lacks: {ANOTHER}"
        for key, value in values.items():
            if hasattr(value, "dtype") and value.numel() > 1 and not fits(value, shapes[index]):
                return (
                    f"holds the optimizer's {key} of parameter {index} as {shown((str(value.dtype), value.shape))}, "
                    f"the parameter being of shape {list(shapes[index])}: {ANOTHER}"
                )
    return None


def fits(value, shape):
    """Is a tensor of an optimizer's state that of a parameter of `shape` (the same shape, a float)?"""
    return tuple(value.shape) == shape and value.is_floating_point()


def shown(found):
    if found is None:
        return "missing"
    return f"{found[0].removeprefix('torch.')} of shape {list(found[1])}" if isinstance(found, tuple) else repr(found)


def say_world(was, now):
    """Before the first step of a resumed run: where its world size changed, or at the same size stage 05's mesh (2
    nodes x 2 ranks, then 4 ranks on one: other sums in other orders), one line saying what that keeps. `was`,
    `now`: the records of the run that saved the checkpoint and of this one."""
    world, meshes = (was.get("world"), now.get("world")), (was.get("mesh"), now.get("mesh"))
    shape = lambda mesh: " x ".join(map(str, mesh))  # noqa: E731
    if all(isinstance(w, int) for w in world) and world[0] != world[1]:
        print0(f"resumed at world size {world[1]} from {world[0]}: the same samples, not bit-identical")
    elif all(isinstance(m, list) for m in meshes) and meshes[0] != meshes[1]:
        print0(f"resumed on a mesh of {shape(meshes[1])} from {shape(meshes[0])}: the same samples, not bit-identical")
