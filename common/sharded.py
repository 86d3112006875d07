"""Stage 05's checkpoints: the model is sharded, so every rank writes its own shards with
torch.distributed.checkpoint into a new folder <output-dir>/epoch-N, and rank 0 then points the link
<output-dir>/checkpoint at it, which is atomic too; the folder it named before stays, named by
<output-dir>/checkpoint-previous, and the one before that goes: only a folder these links named is
ever deleted, whatever other folders are called. Such a checkpoint loads at any world size: each
rank reads the pieces its new shard needs, so every node must see the folder.
"""

import os
import shutil
import warnings

import torch
import torch.distributed as dist

from common.checkpoint import SHARDED, SPLIT, atomic, run_state
from common.environment import is_rank0

# stage 05 under a plain `python train.py`: its sharded checkpoints in one process, as meant
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")


def save(output_dir, epoch, states, step=0):
    """Stage 05: each rank writes its shards into <output-dir>/epoch-N (epoch-N-step-S mid-epoch),
    rank 0 adds state.pt, then switches the link <output-dir>/checkpoint to it, atomically."""
    from torch.distributed import checkpoint as dcp  # here: the stages that do not shard skip it
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(states["model"], states["optimizer"])  # this rank's
    folder = output_dir / (f"epoch-{epoch}-step-{step}" if step else f"epoch-{epoch}")
    writer = dcp.FileSystemWriter(folder)  # its mkdir -p made a moved run folder again: no parent
    writer.fs.mkdir = lambda path: path.mkdir(exist_ok=True)  # `folder` alone
    # tensors only: DCP unpickles any other item unrestricted, which would run whatever it names
    dcp.save({"model": weights, "optimizer": optimizer_state["state"]}, storage_writer=writer)
    if is_rank0():
        rest = {name: thing for name, thing in states.items() if name not in SPLIT}
        # the optimizer's plain values too: loaded with weights_only=True
        groups = {"param_groups": optimizer_state["param_groups"]}
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
