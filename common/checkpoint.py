"""Checkpoints: every finished epoch survives a kill, a time limit or a requeue.

Global rank 0 writes --output-dir/checkpoint.pt at the end of every epoch, atomically: a crash
mid-write leaves the previous checkpoint intact. Rank 0 also reads it back and broadcasts it, so the
output folder need not be on a filesystem that every node sees. Files are loaded with
`weights_only=True`: a checkpoint holds tensors and plain values, never code to run.

A run resumes by itself when Slurm requeued or restarted its job (SLURM_RESTART_COUNT > 0, same job
id, same output folder) or torchrun restarted its workers; otherwise only with --resume [PATH].
"""

import os

import torch
import torch.distributed as dist

from common.distributed import print0

FLAGS = ("dataset", "model", "optimizer", "batch_size", "lr", "gamma", "seed")  # a resumed run must share these


def is_rank0():
    return not dist.is_initialized() or dist.get_rank() == 0


def unwrap(model):
    """The plain model inside DataParallel or DistributedDataParallel: weights saved from it carry no
    `module.` prefix, so any stage loads them."""
    return getattr(model, "module", model)


def restarts(env=os.environ):
    return int(env.get("SLURM_RESTART_COUNT", 0)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0))


def save(args, epoch, model, optimizer, scheduler, scaler, log):
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
            "flags": {name: getattr(args, name) for name in FLAGS},
        }
        path = args.output_dir / "checkpoint.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old checkpoint or the new one, never half of one
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
    differ = [f"--{k.replace('_', '-')} {v}" for k, v in state["flags"].items() if getattr(args, k) != v]
    if differ:
        return f"error: {path} was written with {', '.join(differ)}: resume with the same flags, or use another --output-dir"
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
    if is_rank0():
        output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(unwrap(model).state_dict(), output_dir / "model.pt")
