"""Guard rail: a file of the run that could not be written (or read) in --output-dir, named in one line with what
mends it: free space for a full disk or quota, access for a permission or a read-only file system, which no space
mends; and whether a checkpoint before it is kept."""

import errno
import os
import re
import shutil
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # what free space mends


def written(err, output_dir):
    """Is `err` a failed write of the run (a full disk, a quota, a read-only folder, or any error on a file in
    --output-dir)? Not a read of the task's data, which no free space mends."""
    if not isinstance(err, OSError) or not err.filename:
        return False
    full = err.errno in (*FULL, errno.EROFS)
    return full or (output_dir is not None and Path(err.filename).resolve().is_relative_to(Path(output_dir).resolve()))


def said(err, folder):
    """The line for `err`, a written() one in `folder`: a temporary file (checkpoint.atomic()'s <name>.tmp<pid>) is
    named by the file it was to replace, which is kept where there is one."""
    name = re.sub(r"\.tmp\d+$", "", os.path.basename(err.filename))
    if err.errno not in FULL:  # a permission, a read-only file system: the same at every resume
        return (
            f"error: cannot use {err.filename}: {err.strerror}: give the run's user access to it (a read-only file "
            "system: choose another --output-dir)"
        )
    if os.path.exists(Path(err.filename).with_name(name)):
        kept = f"the previous {name} is kept; free some space or choose another --output-dir, then resume"
    else:  # the run's first: a --resume would find none
        kept = "free some space or choose another --output-dir, then run the same command again"
    return f"error: could not write {err.filename}: {err.strerror} ({free_mib(folder):.0f} MiB free there): {kept}"


def free_mib(folder):
    return shutil.disk_usage(folder).free / 2**20
