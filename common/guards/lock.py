"""Guard rail: one run per output folder. A lock naming its holder, taken before anything else: a second run
into the same folder exits at once naming the first, instead of both overwriting one checkpoint."""

import errno
import fcntl
import json
import os
import re
import socket
import stat
import time

from common.environment import is_rank0, launcher, restarts
from common.guards.check import integer
from common.guards.ending import Refusal
from common.guards.rendezvous import TWO_RANK_0

# checkpoint.atomic()'s temporary files of what a run writes (<name>.tmp<pid>): no other name is a run's
TEMPORARY = re.compile(r"(checkpoint\.pt|checkpoint-previous\.pt|metrics\.csv|model\.pt|run-manifest\.json)\.tmp\d+")


def claim(output_dir, env=os.environ):
    """Take --output-dir for this run before anything else, or exit naming the run that holds it. A lock
    (lockf) on output_dir/.lock, released by the kernel when its process ends, however it ends: a lock
    left by a dead run is free. A live holder is never displaced, with one exception: this same Slurm job
    before its requeue (a higher SLURM_RESTART_COUNT now), whose processes Slurm has ended although on a
    network filesystem a dead node's lock lingers; never a holder alive on this host, which Slurm did not
    end (a second copy of the job). Rank 0 alone claims: only its node needs the folder.
    Returns the open lock file, which the guard rails keep for as long as the run lasts."""
    if not is_rank0(env):
        return None
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": env.get("SLURM_JOB_ID"),
        "restart": integer("SLURM_RESTART_COUNT", 0, env=env),
        "since": time.ctime(),
        "launch": launch(env),
    }
    path = output_dir / ".lock"
    fd = opened(path)
    try:
        # a POSIX lock, this process's alone: the DataLoader workers it forks do not inherit it, as they would
        # a flock, which they kept after a SIGKILL of this process until they noticed (seconds). It ends when
        # this process closes any descriptor of the file: nothing else here opens it
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held by another process
        try:
            held = json.loads(os.pread(fd, 4096, 0))
        except ValueError:  # caught between the holder's truncate and write, or not ours
            held = {}
        held = held if isinstance(held, dict) else {}
        requeued = me["job"] and held.get("job") == me["job"] and held.get("restart", 0) < me["restart"]
        if me["launch"] and held.get("launch") == me["launch"]:  # its rank 0 too: the same launch, store and port
            name = "RANK" if "RANK" in env else "SLURM_PROCID"
            raise Refusal(
                f"error: rank 0: another task has {name} 0 too (host {held.get('host', '?')}, pid "
                f"{held.get('pid', '?')}): {TWO_RANK_0}; the launcher gives each task its own"
            ) from None
        if not requeued or (held.get("host") == me["host"] and alive(held.get("pid"))):
            job = f", Slurm job {held['job']}" if held.get("job") else ""
            raise Refusal(
                f"error: --output-dir {output_dir} is in use by another run (host {held.get('host', '?')}, pid "
                f"{held.get('pid', '?')}{job}, since {held.get('since', '?')}): choose another --output-dir, or end that run"
            ) from None
    except OSError as err:  # a filesystem without locks (some Lustre and NFS mounts): the folder is unguarded
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        print(f"warning: {output_dir} cannot be locked ({err.strerror}): make sure no other run uses it", flush=True)
    if (held := os.pread(fd, 4096, 0)) and not (held.startswith(b"{") and b'"pid"' in held):
        os.close(fd)  # a file some other program keeps under this name: never truncated
        raise Refusal(
            f"error: {path} is not a lock this repository wrote: move it away, or choose another --output-dir"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def launch(env):
    """This process's launch where it is one of several ranks (its job and step, torchrun's run, the rendezvous
    address, the restart counts), as the lock records it: a second task claiming rank 0 holds the same; else None."""
    first = launcher(env)
    if first.world_size in (None, 1) or not first.addr:
        return None
    ids = (env.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"))
    return " ".join([*ids, f"{first.addr}:{first.port}", *map(str, restarts(env))])


def opened(path):
    """The lock file at `path` opened, made with its folder where they are not there yet: never through a link
    (its target would be truncated), nor into a FIFO (O_NONBLOCK: no wait), nor anything but a regular file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Refusal(f"error: {path} is a link: the lock is never taken through one: remove it") from None
        if err.errno in (errno.EEXIST, errno.ENOTDIR):  # the folder, or one above it, is a file
            raise Refusal(
                f"error: --output-dir {path.parent} is a file, or inside one, not a folder: choose a folder"
            ) from None
        raise Refusal(
            f"error: cannot write to --output-dir {path.parent}: {err.strerror}: choose a folder you can write"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refusal(f"error: {path} is not a regular file: remove it, or choose another --output-dir")
    return fd


def alive(pid):
    """Is process `pid` of this host running? (One that is not ours to signal is.)"""
    if not isinstance(pid, int) or pid <= 0:  # a lock file some other program wrote
        return False
    try:
        os.kill(pid, 0)  # no signal: only whether there is a process to send one to
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def sweep(output_dir):
    """Once the folder is this run's (ownership.claim()): what its writers, killed mid-write, left. Only the
    temporary files of names a run writes, never a folder: a refused run, or a user's notes.tmp1, keeps them."""
    for name in os.listdir(output_dir):
        if TEMPORARY.fullmatch(name) and not stat.S_ISDIR(os.lstat(output_dir / name).st_mode):
            (output_dir / name).unlink(missing_ok=True)
