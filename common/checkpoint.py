"""Checkpoints: every finished epoch survives a kill, a time limit or a requeue.

Global rank 0 writes --output-dir/checkpoint.pt at the end of every epoch, atomically: a crash
mid-write leaves the previous checkpoint intact. Rank 0 also reads it back and broadcasts it, so the
output folder need not be on a filesystem that every node sees. Files are loaded with
`weights_only=True`: a checkpoint holds tensors and plain values, never code to run.

Stage 05's model is sharded: every rank writes its own shard with torch.distributed.checkpoint into a
new folder <output-dir>/epoch-N, and rank 0 then points the link <output-dir>/checkpoint at it, which
is atomic too. Such a checkpoint loads at any world size: each rank reads the pieces its new shard needs,
so every node must see the folder.

A run resumes by itself when Slurm requeued or restarted its job (SLURM_RESTART_COUNT > 0, same job
id, same output folder) or torchrun restarted its workers; otherwise only with --resume [PATH], and
only with the options that define the run unchanged (common.cli.DEFINING). A run first claims its
output folder (claim()): two runs writing into one folder would overwrite each other's results.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
import warnings

import torch
import torch.distributed as dist

from common import cli, integrity
from common.distributed import launcher_env, print0, stop
from common.environment import integer

DIVERGED = "the run diverged; the checkpoint in {0} keeps the last good epoch: try a lower --lr (or --amp off)"
# stage 05 run by plain `python train.py` saves and loads its sharded checkpoints in one process, as meant
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
PREVIOUS = "checkpoint-previous.pt"  # the epoch before checkpoint.pt's: a damaged latest leaves one to resume from
_lock = []  # the open lock file: the folder stays claimed for as long as this process lives


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def unwrap(model):
    """The plain model inside DataParallel or DistributedDataParallel: weights saved from it carry no
    `module.` prefix, so any stage loads them."""
    return getattr(model, "module", model)


def claim(output_dir, env=os.environ):
    """Take --output-dir for this run before anything else, or exit naming the run that holds it. A lock
    (flock) on output_dir/.lock, released by the kernel when its process ends, however it ends: a lock
    left by a dead run is free. A live holder is never displaced, with one exception: this same Slurm job
    before its requeue (a higher SLURM_RESTART_COUNT now), whose processes Slurm has ended although on a
    network filesystem a dead node's lock lingers. Rank 0 alone claims: only its node needs the folder."""
    if launcher_env(env)[0] != 0:
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.get("SLURM_JOB_ID"),
          "restart": restarts(env)[0], "since": time.ctime()}  # fmt: skip
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(output_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise SystemExit(
            f"error: cannot write to --output-dir {output_dir}: {err.strerror}: choose a folder you can write"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            held = json.loads(os.pread(fd, 4096, 0))
        except ValueError:  # caught between the holder's truncate and write, or not ours
            held = {}
        held = held if isinstance(held, dict) else {}
        requeued = me["job"] and held.get("job") == me["job"] and held.get("restart", 0) < me["restart"]
        if not requeued:
            job = f", Slurm job {held['job']}" if held.get("job") else ""
            raise SystemExit(
                f"error: --output-dir {output_dir} is in use by another run (host {held.get('host', '?')}, pid "
                f"{held.get('pid', '?')}{job}, since {held.get('since', '?')}): choose another --output-dir, or end that run"
            ) from None
    except OSError as err:  # a filesystem without locks (some Lustre and NFS mounts): the folder is unguarded
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        print(f"warning: {output_dir} cannot be locked ({err.strerror}): make sure no other run uses it", flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _lock.append(fd)


def restarts(env=os.environ):
    return integer("SLURM_RESTART_COUNT", 0, env=env), integer("TORCHELASTIC_RESTART_COUNT", 0, env=env)


def finite(state):
    """Are all the floating-point tensors in `state` (nested dicts and lists) finite? Once an epoch. Of a
    sharded tensor, the shard this rank holds."""
    if hasattr(state, "to_local"):  # a DTensor (not imported: it costs every stage 0.4 s)
        state = state.to_local()
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, (dict, list, tuple)):
        return all(finite(v) for v in (state.values() if isinstance(state, dict) else state))
    return True


@contextlib.contextmanager
def atomic(path, mode="wb", keep=None):
    """Write `path` through a temporary file switched in once complete: a kill, a full disk or any write
    error leaves the previous file whole, and no partial file behind. With `keep`, the file replaced stays
    there under that name (a hard link, switched in atomically too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if keep is not None and path.exists():
            link = keep.with_name(keep.name + ".tmp")
            link.unlink(missing_ok=True)
            try:
                os.link(path, link)
            except OSError:  # a filesystem without hard links (some FUSE mounts): a copy
                shutil.copyfile(path, link)
            os.replace(link, keep)
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one
    except OSError as err:
        tmp.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free / 2**20
        raise SystemExit(
            f"error: could not write {path}: {err.strerror} ({free:.0f} MiB free there): the previous "
            f"{path.name} is kept; free some space or choose another --output-dir, then resume"
        ) from None


def save(args, epoch, model, optimizer, scheduler, scaler, log):
    # every rank holds the same weights: each decides alike, with no collective, never to save a diverged run
    if not finite([unwrap(model).state_dict(), optimizer.state_dict()]):
        stop(f"error: epoch {epoch} left non-finite weights: {DIVERGED.format(args.output_dir)}")
    if is_rank0():
        state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}
        with atomic(args.output_dir / "checkpoint.pt", keep=args.output_dir / PREVIOUS) as f:  # the last two epochs
            torch.save(run_state(args, epoch, scheduler, scaler, log) | state, f)
    if dist.is_initialized():
        dist.barrier()  # every rank leaves the epoch with its checkpoint complete on disk


def run_state(args, epoch, scheduler, scaler, log):
    """What a checkpoint holds besides the weights and the optimizer state: plain values and small tensors."""
    return {
        "epoch": epoch,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        },
        "metrics": log.rows,
        "flags": cli.defining(args),
    }


def save_sharded(args, epoch, model, optimizer, scheduler, scaler, log):
    """Stage 05: each rank writes its shards of the weights and optimizer state into <output-dir>/epoch-N
    (torch.distributed.checkpoint), rank 0 adds state.pt and then switches the link <output-dir>/checkpoint
    to the new folder: a kill before the switch leaves the previous checkpoint whole."""
    from torch.distributed import checkpoint as dcp  # here: the stages that do not shard skip the import
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(model, optimizer)  # this rank's shards, named as in the model
    device = next(model.parameters()).device  # NCCL reduces GPU tensors only
    bad = torch.tensor([float(not finite([weights, optimizer_state]))], device=device)  # each rank sees its shards
    if dist.is_initialized():
        dist.all_reduce(bad)
    if bad.item():
        stop(f"error: epoch {epoch} left non-finite weights: {DIVERGED.format(args.output_dir)}")
    folder = args.output_dir / f"epoch-{epoch}"
    if is_rank0():
        shutil.rmtree(folder, ignore_errors=True)  # what a save killed half-way left behind
    if dist.is_initialized():
        dist.barrier()
    try:
        dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=folder)
    except (OSError, dcp.CheckpointException) as err:  # every rank gets the failures of all
        free = shutil.disk_usage(args.output_dir).free / 2**20
        stop(f"error: could not write {folder}: {failed(err)} ({free:.0f} MiB free there): the previous checkpoint "
             "is kept; free some space or choose another --output-dir, then resume")  # fmt: skip
    if is_rank0():
        with atomic(folder / "state.pt") as f:
            torch.save(run_state(args, epoch, scheduler, scaler, log), f)
        link = args.output_dir / "checkpoint.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(folder.name)
        os.replace(link, args.output_dir / "checkpoint")  # atomic: the old checkpoint or the new one
        for old in epochs(args.output_dir)[2:]:  # the last two complete checkpoints stay
            shutil.rmtree(old)
    if dist.is_initialized():  # a resume at another world size reads every rank's shards: every node must see them
        dist.barrier()  # rank 0 has switched the link
        blind = [None] * dist.get_world_size()
        dist.all_gather_object(blind, None if (folder / "state.pt").exists() else socket.gethostname())
        if any(blind):
            stop(f"error: {args.output_dir} is not shared: {', '.join(sorted(set(filter(None, blind))))} cannot see "
                 "rank 0's checkpoint: in stage 05 every rank writes and reads shards there: choose an --output-dir "
                 "that every node sees")  # fmt: skip


def epochs(output_dir):
    """The sharded checkpoint folders epoch-N in output_dir, newest first."""
    return sorted(
        output_dir.glob("epoch-*"), key=lambda f: int(f.name[6:]) if f.name[6:].isdigit() else -1, reverse=True
    )


def load(path):
    """A checkpoint's run state: checkpoint.pt, or a sharded folder's state.pt with its shards checked and
    "folder" added. An error message (a string) if it is damaged."""
    folder = path.resolve() if path.is_dir() else None
    try:
        state = torch.load(folder / "state.pt" if folder else path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated file, or a pickle that would run code
        return f"{path} is not a checkpoint this code wrote, or is damaged ({type(err).__name__})"
    if not (isinstance(state, dict) and {"epoch", "flags"} <= state.keys() and ("model" in state or folder)):
        return f"{path} is not a training checkpoint (a --save-model file holds weights only): give <output-dir>/checkpoint.pt"
    if folder and (problem := integrity.damage(folder)):
        return f"{path} is damaged: {problem}"
    return state | {"folder": folder}


def fallback(output_dir, damaged):
    """The complete checkpoint before the damaged latest one in output_dir, as a hint: '' if there is none."""
    candidates = [output_dir / PREVIOUS] if damaged.is_file() else [f for f in epochs(output_dir) if f != damaged]
    for path in candidates:
        if path.exists() and isinstance(state := load(path), dict):
            return f": the checkpoint of epoch {state['epoch']} is complete: resume from it with --resume {path}"
    return ""


def read(args, name="checkpoint.pt"):
    """Rank 0: the checkpoint to resume from (a stage 05 folder: its state.pt, with "folder" added), None
    to start afresh, or an error message."""
    own = args.output_dir / name
    if args.resume is None and not any(restarts()):
        for found in (args.output_dir / "checkpoint.pt", args.output_dir / "checkpoint"):
            if found.exists():  # whole or sharded, of any stage: a fresh run would overwrite its metrics.csv
                return (f"error: {found} holds the checkpoint of an earlier run: add --resume to continue "
                        "it (in the stage that wrote it), or choose another --output-dir")  # fmt: skip
        return None
    path = own if args.resume in (None, True) else args.resume
    if not path.exists():
        other = args.output_dir / ("checkpoint.pt" if name == "checkpoint" else "checkpoint")
        hint = (
            f" (it holds {other.name}, of {'stages 01-04' if other.suffix else 'stage 05'})" if other.exists() else ""
        )
        return None if args.resume is None else f"error: no {path.name} in {path.parent} to resume from{hint}"
    state = load(path)
    if isinstance(state, str):
        hint = fallback(args.output_dir, path.resolve()) if path == own else ""
        return f"error: {state}{hint or ': delete it or use another'}"
    if state["folder"] and name != "checkpoint":
        return f"error: {path} is a sharded checkpoint of stage 05: resume it there, or export its weights with its --save-model"
    # a checkpoint from before an option existed does not record it: what it records must match
    now = cli.defining(args)
    differ = [f"--{k.replace('_', '-')} {v} (now {now.get(k)})" for k, v in state["flags"].items() if now.get(k) != v]
    if differ:
        return f"error: {path} was written with {', '.join(differ)}: resume with the same options, or use another --output-dir"
    return state


def resume(args, model, optimizer, scheduler, scaler, log, name="checkpoint.pt"):
    """Load the checkpoint this run should continue from, if any: returns the first epoch to run."""
    box = [read(args, name) if is_rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box)  # every rank gets rank 0's verdict and state
    state = box[0]
    if isinstance(state, str):
        stop(state)  # every rank has the verdict; rank 0 says it
    if state is None:
        return 1
    try:
        if name == "checkpoint":
            load_sharded(state, model, optimizer)
        else:
            unwrap(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        stop(f"error: the checkpoint does not match this model: {str(err).splitlines()[0][:300]}")
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    log.restore(state["metrics"])
    slurm, torchrun = restarts()
    print0(f"resumed after epoch {state['epoch']} (Slurm restart {slurm}, torchrun restart {torchrun})")
    return state["epoch"] + 1


def resume_sharded(args, model, optimizer, scheduler, scaler, log):
    """Stage 05's resume: from its own sharded checkpoint <output-dir>/checkpoint, saved at any world
    size, or with --resume from another checkpoint folder or from a checkpoint.pt of stages 01-04."""
    return resume(args, model, optimizer, scheduler, scaler, log, name="checkpoint")


def load_sharded(state, model, optimizer):
    """Into a sharded model: each rank reads from the folder the pieces of its own shards (at any world
    size: the checkpoint records where each piece lies), or takes its shards of a whole checkpoint.pt."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if state["folder"]:
        weights, optimizer_state = get_state_dict(model, optimizer)  # the shapes to fill, this rank's shards
        pieces = {"model": weights, "optimizer": optimizer_state}
        try:
            dcp.load(pieces, checkpoint_id=state["folder"])
        except dcp.CheckpointException as err:  # a shard missing (a folder not shared), or of another model
            stop(f"error: cannot load the checkpoint {state['folder']}: {failed(err)}: resume from a complete one")
        set_state_dict(model, optimizer, model_state_dict=pieces["model"], optim_state_dict=pieces["optimizer"])
        return
    names = [name for name, _ in model.named_parameters()]  # optimizer.state_dict() numbers them in this order
    saved = state["optimizer"]
    optimizer_state = {
        "state": {names[i]: value for i, value in saved["state"].items()},
        "param_groups": [group | {"params": [names[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))  # fmt: skip


def failed(err):
    """The first failure of a torch.distributed.checkpoint save or load, in a few words: which rank, what."""
    rank, (cause, _) = next(iter(err.failures.items())) if hasattr(err, "failures") else ("?", (err, None))
    if isinstance(cause, OSError) and cause.strerror:
        return f"rank {rank}: {cause.strerror}" + (f" ({cause.filename})" if cause.filename else "")
    return f"rank {rank}: {str(cause).splitlines()[0][:200]}"


def save_model(model, output_dir):
    """The whole weights, as stage 01's model names them: from any stage, a file any stage loads."""
    weights = unwrap(model).state_dict()
    if any(hasattr(w, "to_local") for w in weights.values()):  # stage 05's DTensors: gather the shards on rank 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not finite(weights):  # every rank's own weights, or rank 0's whole ones (the others then have none)
        stop(f"error: the trained weights are not finite: {DIVERGED.format(output_dir)}")
    if is_rank0():
        with atomic(output_dir / "model.pt") as f:
            torch.save(weights, f)
