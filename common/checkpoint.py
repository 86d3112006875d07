"""Checkpoints: a run that is stopped continues where it stopped.

What a checkpoint holds: the epoch (and, saved mid-epoch, the step), the random generators' states,
and the state_dict() of every object in `states`, the dict a stage makes of what it trains with: the
model, the optimizer, the learning-rate schedule, the gradient scaler and the metrics so far.

Stages 01-04: global rank 0 writes <output-dir>/checkpoint.pt at the end of every epoch, atomically:
a crash mid-write leaves the previous checkpoint whole. Files are loaded with `weights_only=True`: a
checkpoint holds tensors and plain values, never code to run.

Stage 05's model is sharded: every rank writes its own shards with torch.distributed.checkpoint into
a new folder <output-dir>/epoch-N, and rank 0 then points the link <output-dir>/checkpoint at it,
which is atomic too; the folder it named before stays, named by <output-dir>/checkpoint-previous,
and the one before that goes: only a folder these links named is ever deleted, whatever other
folders are called. Such a checkpoint loads at any world size: each rank reads the pieces its new
shard needs, so every node must see the folder.

A run continues a checkpoint (latest()) when asked to with --resume, and by itself when Slurm
requeued its job or torchrun restarted its workers: the requeued job runs the same command again,
and picks up where the last checkpoint left it, part-way through an epoch if it was stopped there.
restore() loads it: rank 0 reads it and hands it to every rank, so that only rank 0's node needs a
whole checkpoint; each rank reads its own pieces of a sharded one.
"""

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from common import shards
from common.environment import is_rank0, restarts
from common.sampling import generators, set_generators

WHOLE, SHARDED = "checkpoint.pt", "checkpoint"  # 01-04's file; 05's link to its newest epoch-N
SPLIT = ("model", "optimizer")  # what stage 05 writes as shards; the rest of `states`: state.pt

# stage 05 under a plain `python train.py`: its sharded checkpoints in one process, as meant
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")


def unwrap(model):
    """The model inside DataParallel or DDP: its weights, no `module.` prefix, load anywhere."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def atomic(path, mode="wb"):
    """Write `path` whole or not at all: into a temporary file of this process, switched in once
    complete. On any error the temporary file goes and the old `path` stays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # two writers never share one
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one
    except (OSError, RuntimeError) as err:  # a full disk (torch.save's RuntimeError): name the file
        cause = err.__context__ if isinstance(err, RuntimeError) else err
        if not isinstance(cause, OSError):
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)


def run_state(epoch, step, states):
    """What a checkpoint holds besides stage 05's shards: plain values and small tensors."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    rng = generators() | {"cuda": cuda}  # every generator a step may draw from
    saved = {name: unwrap(thing).state_dict() for name, thing in states.items()}
    return {"epoch": epoch, "step": step, "rng": rng} | saved


def save(output_dir, epoch, states, step=0):
    """Stages 01-04: the end of `epoch` (or `step` steps into it): all ranks call, rank 0 saves."""
    if is_rank0():
        with atomic(output_dir / WHOLE) as f:
            torch.save(run_state(epoch, step, states), f)
    if dist.is_initialized():
        dist.barrier()  # every rank leaves with the checkpoint complete on disk


def save_sharded(output_dir, epoch, states, step=0):
    """Stage 05: each rank writes its shards into <output-dir>/epoch-N (epoch-N-step-S mid-epoch),
    rank 0 adds state.pt, then switches the link <output-dir>/checkpoint to it, atomically."""
    from torch.distributed import checkpoint as dcp  # here: the stages that do not shard skip it
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(states["model"], states["optimizer"])  # this rank's
    folder = output_dir / (f"epoch-{epoch}-step-{step}" if step else f"epoch-{epoch}")
    if is_rank0():
        shutil.rmtree(folder, ignore_errors=True)  # what a save killed half-way left behind
    if dist.is_initialized():
        dist.barrier()
    # tensors only: DCP unpickles any other item unrestricted, which would run whatever it names
    dcp.save({"model": weights, "optimizer": optimizer_state["state"]}, checkpoint_id=folder)
    buffers = every_ranks_buffers(states["model"]) if step else None  # one copy in the shards
    if is_rank0():
        rest = {name: thing for name, thing in states.items() if name not in SPLIT}
        # the optimizer's plain values too: loaded with weights_only=True
        groups = {"param_groups": optimizer_state["param_groups"], "buffers": buffers}
        with atomic(folder / "state.pt") as f:
            torch.save(run_state(epoch, step, rest) | groups, f)
        latest, before = linked(output_dir / SHARDED), linked(output_dir / f"{SHARDED}-previous")
        if latest not in (None, folder.name):  # the checkpoint this one replaces stays, as previous
            point(output_dir / f"{SHARDED}-previous", latest)
        point(output_dir / SHARDED, folder.name)
        if latest not in (None, folder.name) and before not in (None, latest, folder.name):
            shutil.rmtree(output_dir / before, ignore_errors=True)  # what no link names now goes
    if dist.is_initialized():
        dist.barrier()  # rank 0 has switched the link


def every_ranks_buffers(model):
    """Each rank's floating-point buffers, on rank 0: FSDP shards none, and until an evaluation
    averages them (distributed.average_buffers) each rank's BatchNorm statistics are its own."""
    mine = {name: b.detach().cpu() for name, b in model.named_buffers() if b.is_floating_point()}
    everyone = [mine] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.gather_object(mine, everyone if is_rank0() else None)
    return everyone


def set_buffers(model, saved):
    """This rank's own buffers as saved; at another world size, the mean of every rank's."""
    rank, ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved[0]:
                own = [ranks_own[name] for ranks_own in saved]
                buffer.copy_(own[rank] if len(own) == ranks else sum(own) / len(own))


def linked(link):
    """The folder `link` names beside it, or None: rotation deletes only what this run linked."""
    name = os.readlink(link) if os.path.islink(link) else None
    return name if name and "/" not in name and name not in (".", "..") else None


def point(link, name):
    """Switch `link` to the folder `name` beside it, atomically: readers see the old or the new."""
    tmp = link.with_name("checkpoint.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    os.replace(tmp, link)


def latest(args, name=WHOLE):
    """The checkpoint to continue, or None: --resume PATH, or --output-dir's (--resume, restart)."""
    own = args.output_dir / name
    return own if args.resume is True or (restarted() and own.exists()) else args.resume


def restarted():
    """Did Slurm requeue this job, or torchrun restart its workers on any rank's node?"""
    everyone = [any(restarts())] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, everyone[0])
    return any(everyone)


def read_on_rank0(path):
    """read(path) on rank 0, handed to every rank."""
    box = [read(path) if is_rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    return box[0]


def read(path):
    """The checkpoint.pt at `path`, or a stage 05 folder's state.pt and "folder": the shards'."""
    folder = path.resolve() if path.is_dir() else None
    state = torch.load(folder / "state.pt" if folder else path, "cpu", weights_only=True)
    return state | {"folder": folder} if isinstance(state, dict) else state


def restore(path, states):
    """Load the checkpoint at `path` (None: none) into `states`: returns where to start, (epoch,
    steps done in it): (1, 0) without one, the next epoch after a whole one, the same after part."""
    if path is None:
        return 1, 0
    state = read_on_rank0(path)
    unwrap(states["model"]).load_state_dict(state["model"])
    states["optimizer"].load_state_dict(state["optimizer"])
    return restore_rest(state, states)


def restore_rest(state, states):
    """Everything but the model and the optimizer, and the random generators."""
    for name, thing in states.items():
        if name not in SPLIT:
            thing.load_state_dict(state[name])
    if "python" in state["rng"]:  # a checkpoint of an older version holds torch's alone
        set_generators(state["rng"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return (state["epoch"], state["step"]) if state["step"] else (state["epoch"] + 1, 0)


def restore_sharded(path, states):
    """Stage 05's restore(): each rank reads from the folder the pieces of its own shards (at any
    world size: the checkpoint records where each lies), or its shards of a whole checkpoint.pt."""
    if path is None:
        return 1, 0
    state = read_on_rank0(path)
    load_sharded(state, states["model"], states["optimizer"])
    if state.get("buffers"):  # saved mid-epoch: each rank's own statistics
        set_buffers(states["model"], state["buffers"])
    return restore_rest(state, states)


def load_sharded(state, model, optimizer):
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    folder = state["folder"]
    if folder:  # the shapes to fill are this rank's shards
        weights, optimizer_state = sd.get_state_dict(model, optimizer)
        pieces = {"model": weights, "optimizer": optimizer_state["state"]}
        # DCP's own reader unpickles .metadata as it is: shards.reader() builds DCP's classes alone
        dcp.load(pieces, checkpoint_id=folder, storage_reader=shards.reader(folder))
        optimizer_state = {"state": pieces["optimizer"], "param_groups": state["param_groups"]}
        sd.set_state_dict(model, optimizer, model_state_dict=pieces["model"],
                          optim_state_dict=optimizer_state)  # fmt: skip
        return
    # a whole checkpoint: optimizer.state_dict() numbers the parameters in this order
    names = [name for name, _ in model.named_parameters()]
    saved = state["optimizer"]
    groups = [g | {"params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]
    by_name = {"state": {names[i]: v for i, v in saved["state"].items()}, "param_groups": groups}
    sd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=by_name,
                      options=sd.StateDictOptions(full_state_dict=True))  # fmt: skip


def save_model(model, output_dir):
    """The whole weights, as stage 01's model names them: from any stage, a file any stage loads."""
    weights = unwrap(model).state_dict()
    if any(hasattr(w, "to_local") for w in weights.values()):  # stage 05's: gathered on rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=whole)
    if is_rank0():
        with atomic(output_dir / "model.pt") as f:
            torch.save(weights, f)
