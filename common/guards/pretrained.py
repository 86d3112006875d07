"""Guard rail: a task's weights. Its file of whole weights (weights(args)), checked before any rank loads it: a
file torch wrote, a state dict, keys that fit model(args) but FRESH's (a new head), and each of FRESH's prefixes
naming keys of the file; and, at stage 05, what the meta device loses: weights model(args) loads itself, a layer it
deep-copies (its copies start equal on the CPU), an init_weights() that takes no layer."""

import inspect
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from common import models
from common.environment import is_rank0
from common.guards.bounded import Refused, torch_file
from common.guards.ending import stop
from common.options.hooks import kept_fresh

FRESH = 'name the keys to leave at their initialisation (a new head) in the task: FRESH = ("fc.",)'
STATE_DICT = "give a torch.save'd state dict of the task's model"
UNWRAP = (
    "save the model inside its wrapper (DDP's or DataParallel's model.module), or strip the prefix in weights(args)"
)


def check_weights(args, task):
    """The task's `weights(args)` file, which rank 0 alone reads at stage 05 (hooks.load_weights()): checked there
    against what it declares, headers only, before it is trusted; a FIFO blocked rank 0 for ever, a file cut short
    was torch's "central directory" error naming no file; keys that do not fit model(args) were torch's message, the
    keys elided. Every rank ends with rank 0's verdict. Every stage starts from the file (common/options/hooks.py)."""
    if not getattr(task, "weights", None):
        return
    path, problem, fix = is_rank0() and task.weights(args), None, STATE_DICT
    path = path and Path(path)
    if path and not path.is_file():
        problem = "does not exist" if not path.exists() else "is not a regular file (a FIFO, a socket or a device)"
    elif path:
        try:
            torch_file(path)
            found = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped: no copy read
        except (Refused, OSError) as err:
            problem = f"is damaged or no file torch.save wrote ({str(err).removeprefix(str(path)).lstrip(': ')})"
        except Exception as err:  # a pickle weights_only refuses: it may be planted
            problem = f"cannot be loaded with weights_only=True ({type(err).__name__})"
        else:
            if not (isinstance(found, dict) and found and all(torch.is_tensor(v) for v in found.values())):
                problem = "holds no state dict, names of tensors (a training checkpoint? --save-model writes one)"
            elif stray := [p for p in kept_fresh(task) if not any(k.startswith(p) for k in found) or not p]:
                some = ", ".join(list(found)[:3])
                problem = (
                    f"has {'every' if not stray[0] else 'no'} key starting with FRESH's {stray[0]!r} ({some}, ...)"
                )
                fix = FRESH
            elif misfit := misfits(found, task, args):
                problem, fix = f"does not fit model(args): {misfit[0]}", misfit[1]
    box = [problem and f"error: --task {args.task}: its weights(args) file {path} {problem}: {fix}"]
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    if box[0]:
        stop(box[0])


class Loads(TorchFunctionMode):
    """Notes a copy of values into a tensor on the meta device, which keeps none: a load_state_dict() lost."""

    def __init__(self):
        super().__init__()
        self.lost = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and args[0].is_meta and not args[1].is_meta:
            self.lost = True
        return func(*args, **(kwargs or {}))


def check_meta_load(args, task):
    """Stage 05 builds model(args) on the meta device (shapes, no values): weights that model(args) loads itself
    (the torchvision idiom) were lost there, and the run trained from a random start, unsaid. One line instead.
    A task built whole (META = False) is built here on the meta device too, for its units (check_units())."""
    if not hasattr(args, "full_shard"):
        return
    loads, copies = Loads(), Copies()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), loads, copies, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own on a load onto meta: this line says it
            model = task.model(args)
    except Exception:  # the stage's own build names what fails
        return
    check_units(args, task, model)
    if not getattr(task, "META", True):
        return
    if loads.lost:
        stop(
            f"error: --task {args.task}: model(args) loads weights itself, which stage 05 would lose: it builds the "
            "model on the meta device (shapes, no values) and would train from a random start: return the file from "
            "weights(args) instead (rank 0 maps it, each rank receives its shards), or set META = False in the task"
        )
    if copies.made:  # nn.TransformerEncoder's layers: their first one, deep-copied
        stop(
            f"error: --task {args.task}: model(args) deep-copies a layer ({copies.made}): on the CPU the copies start "
            "equal to it, but stage 05 fills each from its own reset_parameters() on the meta device, another start "
            "than stage 01's at the same seed: build each layer anew, or set META = False in the task"
        )
    init = getattr(task, "init_weights", None) or getattr(model, "init_weights", None)
    if init is not None and not takes_a_layer(init):
        stop(
            f"error: --task {args.task}: {'the task' if hasattr(task, 'init_weights') else 'the model'}'s "
            "init_weights() takes no layer: stage 05 fills the model layer by layer, applying it to each as "
            "model.apply(init_weights) does: give it one (init_weights(layer)), or set META = False in the task"
        )


def check_units(args, task, model):
    """Stage 05 shards each unit (a BatchNorm under --amp, then the task's blocks(), else common/models.py's, then
    the root) over its own parameters: a weight tied across two (an embedding in a block, the head that shares it
    at the root) failed as FSDP sharded it, with torch's advice to shard both modules together, which no task can."""
    units = [
        *(models.norms(model) if args.amp else []),
        *models.gathered(getattr(task, "blocks", models.blocks)(model)),
    ]
    names = {module: name or "model" for name, module in model.named_modules()}
    unit_of = {}  # a module: the first unit holding it (a BatchNorm's own before its block's); the root's: none
    for i, unit in enumerate(units):
        for module in unit.modules():
            unit_of.setdefault(module, i)
    owners = {}  # a parameter's id: the modules that hold it themselves
    for module in model.modules():
        for parameter in (p for p in module._parameters.values() if p is not None):
            owners.setdefault(id(parameter), []).append(module)
    for held in owners.values():
        within = {unit_of.get(module) for module in held}
        if len(within) > 1:
            tied = " and ".join(names[module] for module in held)
            stop(
                f"error: --task {args.task}: {tied} share a weight, and stage 05 shards them in two units (blocks(), "
                "else each layer of a Sequential or ModuleList): return blocks(model) that holds both in one, or "
                "leaves both out (to the root's unit)"
            )


def takes_a_layer(init):
    """Can `init` be called with one layer? (A builtin without a signature: the call says.)"""
    try:
        inspect.signature(init).bind(None)
    except TypeError:
        return False
    except ValueError:
        pass
    return True


class Copies:
    """Notes a parameter deep-copied while it lasts (copy.deepcopy of a layer): `made`, the first one's shape."""

    def __enter__(self):
        self.made, self.deepcopy = None, nn.Parameter.__deepcopy__

        def noted(parameter, memo):
            self.made = self.made or f"a parameter of shape {list(parameter.shape)}"
            return self.deepcopy(parameter, memo)

        nn.Parameter.__deepcopy__ = noted
        return self

    def __exit__(self, *_):
        nn.Parameter.__deepcopy__ = self.deepcopy


def misfits(found, task, args):
    """The keys of `found` that do not fit model(args), built on the meta device (shapes alone), but FRESH's: the
    first few missing, unexpected, mis-shaped, integer where the model's are floats, or holding a NaN or an
    infinity, and their counts; None if it fits or cannot be built so."""
    fresh = kept_fresh(task)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = task.model(args).state_dict()
    except Exception:  # its own load names what fails
        return None
    want = {k: list(t.shape) for k, t in model.items() if not k.startswith(fresh)}
    got = {k: list(t.shape) for k, t in found.items() if not k.startswith(fresh)}
    kinds = {
        "missing": [k for k in want if k not in got],
        "unexpected": [k for k in got if k not in want],
        "mis-shaped": [
            f"{k} {got[k]} in the file, {want[k]} in the model" for k in want if got.get(k, want[k]) != want[k]
        ],
        # loaded as they are, an integer tensor is rounded into the weights, a NaN trains as a diverged run
        "not floating-point": [
            f"{k} {found[k].dtype}"
            for k in want
            if k in got and model[k].is_floating_point() > found[k].is_floating_point()
        ],
        "not finite": [k for k in want if k in got and found[k].is_floating_point() and not found[k].isfinite().all()],
    }
    said = [
        f"{len(keys)} {kind} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        for kind, keys in kinds.items()
        if keys
    ]
    if not said:
        return None
    if wrapper := prefix(got, want):  # every key of the file is one of the model's, behind one prefix
        first = next(iter(got))
        return f"its keys are the model's behind {wrapper!r} ({first} for {first.removeprefix(wrapper)})", UNWRAP
    if any(kinds[kind] for kind in ("missing", "unexpected", "mis-shaped")):  # a new head, or another model
        return "; ".join(said), FRESH
    return "; ".join(said) + ": a fault in the values", STATE_DICT


def prefix(got, want):
    """The prefix that the keys `got` of a file add to a model's `want` (DDP's and DataParallel's "module.",
    torch.compile's "_orig_mod."), or None."""
    first = next(iter(got), "")
    for cut in (first[: i + 1] for i, c in enumerate(first) if c == "."):
        if all(k.startswith(cut) for k in got) and {k.removeprefix(cut) for k in got} == set(want):
            return cut
    return None
