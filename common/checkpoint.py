"""Checkpoints: a run that is stopped continues where it stopped.

What a checkpoint holds: the epoch (and, saved mid-epoch, the step) and the state_dict() of every
object in `states`, the dict a stage makes of what it trains with: the model, the optimizer, the
learning-rate schedule and the metrics so far (--amp: the loss scaler; the guard rails add the
random generators, common/guards/randomness.py).

Global rank 0 writes <output-dir>/checkpoint.pt at the end of every epoch, atomically: a crash
mid-write leaves the previous checkpoint whole. Files are loaded with `weights_only=True`: a
checkpoint holds tensors and plain values, never code to run. Stage 05's sharded checkpoints:
common/sharded.py.

A run continues a checkpoint (latest()) when asked to with --resume, and by itself when Slurm
requeued its job or torchrun restarted its workers: the requeued job runs the same command again,
and picks up where the last checkpoint left it. restore() (common/options/resuming.py) loads it:
rank 0 reads it and hands it to every rank, so that only rank 0's node needs the checkpoint.
"""

import contextlib
import os

import torch
import torch.distributed as dist

from common.environment import is_rank0, restarts

WHOLE, SHARDED = "checkpoint.pt", "checkpoint"  # 01-04's file; 05's link to its newest epoch-N
SPLIT = ("model", "optimizer")  # what stage 05 writes as shards; the rest of `states`: state.pt


def unwrap(model):
    """The model inside DataParallel or DDP: its weights, no `module.` prefix, load anywhere."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def atomic(path, mode="wb"):
    """Write `path` whole or not at all: into a temporary file of this process, switched in once
    complete. On any error it goes, the old `path` stays; a folder gone is one, never made again."""
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
    saved = {name: unwrap(thing).state_dict() for name, thing in states.items()}
    return {"epoch": epoch, "step": step} | saved


def save(output_dir, epoch, states, step=0):
    """Stages 01-04: the end of `epoch` (or `step` steps into it): all ranks call, rank 0 saves."""
    if is_rank0():
        with atomic(output_dir / WHOLE) as f:
            torch.save(run_state(epoch, step, states), f)
    if dist.is_initialized():
        dist.barrier()  # every rank leaves with the checkpoint complete on disk


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
