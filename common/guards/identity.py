"""Guard rail: a run holds its output folder by what it is, not by its path. The lesson writes by path
(`args.output_dir / name`), made absolute once by the parser before a task's code runs (cli.parse_args()); a
folder renamed, moved or replaced while the run trains, or its `.lock` removed (a second run may then hold the
folder), leaves that path naming another folder, or none: atomic() would make it again, and the run's checkpoints
would land in another run's folder. So rank 0 records, when it takes the lock (lock.claim()), the folder's device
and inode and those of the lock it holds, and before every save every rank hears whether they still are the ones
at that path: where not, the run stops in one line, and writes nothing anywhere."""

import os
from typing import NamedTuple

import torch.distributed as dist

from common.guards.ending import stop


class Held(NamedTuple):
    """The folder rank 0 took, as (device, inode), and the lock file it holds open there."""

    folder: object
    place: tuple
    lock: tuple


def held(output_dir, fd):
    """Rank 0, once its lock `fd` is taken in `output_dir`: what the folder and the lock are; None elsewhere."""
    if fd is None:
        return None
    lock = os.fstat(fd)
    return Held(output_dir, where(os.stat(output_dir)), where(lock))


def where(status):
    return status.st_dev, status.st_ino


def lost(hold):
    """Why `hold`'s path no longer names the folder rank 0 took, or its lock: one line, else None."""
    try:
        place = where(os.stat(hold.folder))
    except OSError:
        place = None
    if place != hold.place:
        what = "is gone" if place is None else "is another folder now"
        return (
            f"error: --output-dir {hold.folder} {what}: the folder this run wrote in was moved, renamed or replaced "
            "while it trained; it stops without saving: its checkpoints, if it saved any, went with the folder: "
            "resume it there"
        )
    try:
        lock = where(os.lstat(hold.folder / ".lock"))
    except OSError:
        lock = None
    if lock != hold.lock:
        return (
            f"error: {hold.folder / '.lock'}, this run's lock, was removed or replaced while it trained (another run "
            "may write in the folder now): it stops without saving; end the other run, then resume this one"
        )
    return None


def check_held(hold):
    """Every rank, before a save: the folder and its lock are still those rank 0 took, or every rank stops with
    rank 0's line (stage 05's ranks each write their shards there)."""
    box = [lost(hold) if hold is not None else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    if box[0]:
        stop(box[0])
