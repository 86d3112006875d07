"""Checkpoints: every finished epoch survives a kill, a time limit or a requeue.

Global rank 0 writes --output-dir/checkpoint.pt at the end of every epoch, atomically: a crash
mid-write leaves the previous checkpoint intact. Rank 0 also reads it back and broadcasts it, so the
output folder need not be on a filesystem that every node sees. Files are loaded with
`weights_only=True`: a checkpoint holds tensors and plain values, never code to run.

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

import torch
import torch.distributed as dist

from common import cli
from common.distributed import launcher_env, print0, stop

DIVERGED = "the run diverged; {0}/checkpoint.pt keeps the last good epoch: try a lower --lr (or --amp off)"
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
    left by a dead run is free. A held lock recorded by this same Slurm job is its own run from before a
    requeue (on a network filesystem a dead node's lock lingers), and is taken over. Rank 0 alone claims:
    only its node needs the folder."""
    if launcher_env(env)[0] != 0:
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.get("SLURM_JOB_ID"), "since": time.ctime()}
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
        except ValueError:  # caught between the holder's truncate and write
            held = {}
        if not (me["job"] and held.get("job") == me["job"]):
            job = f", Slurm job {held['job']}" if held.get("job") else ""
            raise SystemExit(
                f"error: --output-dir {output_dir} is in use by another run (host {held.get('host')}, pid "
                f"{held.get('pid')}{job}, since {held.get('since')}): choose another --output-dir, or end that run"
            ) from None
    except OSError as err:  # a filesystem without locks (some Lustre and NFS mounts): the folder is unguarded
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        print(f"warning: {output_dir} cannot be locked ({err.strerror}): make sure no other run uses it", flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _lock.append(fd)


def restarts(env=os.environ):
    return int(env.get("SLURM_RESTART_COUNT", 0)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0))


def finite(state):
    """Are all the floating-point tensors in `state` (nested dicts and lists) finite? Once an epoch."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, (dict, list, tuple)):
        return all(finite(v) for v in (state.values() if isinstance(state, dict) else state))
    return True


@contextlib.contextmanager
def atomic(path, mode="wb"):
    """Write `path` through a temporary file switched in once complete: a kill, a full disk or any write
    error leaves the previous file whole, and no partial file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
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
        state = {
            "epoch": epoch,
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": {
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            },
            "metrics": log.rows,
            "flags": cli.defining(args),
        }
        with atomic(args.output_dir / "checkpoint.pt") as f:
            torch.save(state, f)
    if dist.is_initialized():
        dist.barrier()  # every rank leaves the epoch with its checkpoint complete on disk


def read(args):
    """Rank 0: the checkpoint to resume from, None to start afresh, or an error message."""
    own = args.output_dir / "checkpoint.pt"
    if args.resume is None and not any(restarts()):
        if own.exists():
            return f"error: {own} exists: add --resume to continue that run, or choose another --output-dir"
        return None
    path = own if args.resume in (None, True) else args.resume
    if not path.exists():
        return None if args.resume is None else f"error: no checkpoint at {path} to resume from"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated file, or a pickle that would run code
        return f"error: {path} is not a checkpoint this code wrote ({type(err).__name__}): delete it or use another"
    if not (isinstance(state, dict) and {"epoch", "model", "flags"} <= state.keys()):
        return f"error: {path} is not a training checkpoint (a --save-model file holds weights only): give <output-dir>/checkpoint.pt"
    # a checkpoint from before an option existed does not record it: what it records must match
    now = cli.defining(args)
    differ = [f"--{k.replace('_', '-')} {v} (now {now.get(k)})" for k, v in state["flags"].items() if now.get(k) != v]
    if differ:
        return f"error: {path} was written with {', '.join(differ)}: resume with the same options, or use another --output-dir"
    return state


def resume(args, model, optimizer, scheduler, scaler, log):
    """Load the checkpoint this run should continue from, if any: returns the first epoch to run."""
    box = [read(args) if is_rank0() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box)  # every rank gets rank 0's verdict and state
    state = box[0]
    if isinstance(state, str):
        raise SystemExit(state)
    if state is None:
        return 1
    try:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise SystemExit(f"error: the checkpoint does not match this model: {err}") from None
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    log.restore(state["metrics"])
    slurm, torchrun = restarts()
    print0(f"resumed after epoch {state['epoch']} (Slurm restart {slurm}, torchrun restart {torchrun})")
    return state["epoch"] + 1


def save_model(model, output_dir):
    if not finite(unwrap(model).state_dict()):
        stop(f"error: the trained weights are not finite: {DIVERGED.format(output_dir)}")
    if is_rank0():
        with atomic(output_dir / "model.pt") as f:
            torch.save(unwrap(model).state_dict(), f)
