"""Guard rail: the output folder. One run per folder (claim: a lock naming its holder), and every file a
run writes there either whole or not at all (atomic), never holding a non-finite number (finite), and
a sharded checkpoint checked whole before a resume reads it (damage), its metadata read by an unpickler
that runs nothing (metadata). The checkpoint and metrics modules call these at the one line where they
write or read."""

import contextlib
import errno
import fcntl
import glob
import json
import os
import pickle
import shutil
import socket
import time

import torch
import torch.distributed as dist

from common.environment import integer, is_rank0

_lock = []  # the open lock file: the folder stays claimed for as long as this process lives


def claim(output_dir, env=os.environ):
    """Take --output-dir for this run before anything else, or exit naming the run that holds it. A lock
    (lockf) on output_dir/.lock, released by the kernel when its process ends, however it ends: a lock
    left by a dead run is free. A live holder is never displaced, with one exception: this same Slurm job
    before its requeue (a higher SLURM_RESTART_COUNT now), whose processes Slurm has ended although on a
    network filesystem a dead node's lock lingers; never a holder alive on this host, which Slurm did not
    end (a second copy of the job). Rank 0 alone claims: only its node needs the folder."""
    if not is_rank0(env):
        return
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.get("SLURM_JOB_ID"),
          "restart": integer("SLURM_RESTART_COUNT", 0, env=env), "since": time.ctime()}  # fmt: skip
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(output_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise SystemExit(
            f"error: cannot write to --output-dir {output_dir}: {err.strerror}: choose a folder you can write"
        ) from None
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
        if not requeued or (held.get("host") == me["host"] and alive(held.get("pid"))):
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
    """Write `path` through a temporary file of this writer's own, switched in once complete: a kill, a full
    disk or any write error leaves the previous file whole, and no partial file behind. With `keep`, the file
    replaced stays there under that name (a hard link, switched in atomically too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, link = temporary(path), temporary(keep) if keep is not None else None
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if keep is not None and path.exists():
            try:
                os.link(path, link)
            except OSError:  # a filesystem without hard links (some FUSE mounts): a copy
                shutil.copyfile(path, link)
            os.replace(link, keep)
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one
    except BaseException as err:
        for partial in filter(None, (tmp, link)):
            partial.unlink(missing_ok=True)
        # torch.save turns the file's OSError (a full disk) into a RuntimeError ('unexpected pos'), its context
        cause = err.__context__ if isinstance(err, RuntimeError) else err
        if not isinstance(cause, OSError):
            raise
        free = shutil.disk_usage(path.parent).free / 2**20
        raise SystemExit(
            f"error: could not write {path}: {cause.strerror or cause} ({free:.0f} MiB free there): the previous "
            f"{path.name} is kept; free some space or choose another --output-dir, then resume"
        ) from None


def temporary(path):
    """This process's temporary file for `path`, named by host and pid: two writers (two runs, were a lock ever
    to fail) never write into one. What writers on this host left when killed mid-write goes first."""
    prefix = f"{path.name}.{socket.gethostname()}-"
    for left in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = left.name[len(prefix) : -len(".tmp")]
        if pid.isdigit() and not alive(int(pid)):
            left.unlink(missing_ok=True)
    return path.with_name(f"{prefix}{os.getpid()}.tmp")


def check_shared(output_dir, folder):
    """Stage 05, after a save: a resume at another world size reads every rank's shards, so every node must
    see the folder rank 0 wrote; one line naming the hosts that cannot."""
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if (folder / "state.pt").exists() else socket.gethostname())
    if any(blind):
        message = (f"error: {output_dir} is not shared: {', '.join(sorted(set(filter(None, blind))))} cannot see "
                   "rank 0's checkpoint: in stage 05 every rank writes and reads shards there: choose an "
                   "--output-dir that every node sees")  # fmt: skip
        raise SystemExit(message if is_rank0() else 1)


def describe(err):
    """The first failure of a torch.distributed.checkpoint save or load, in a few words: which rank, what."""
    rank, (cause, _) = next(iter(err.failures.items())) if hasattr(err, "failures") else ("?", (err, None))
    if isinstance(cause, OSError) and cause.strerror:
        return f"rank {rank}: {cause.strerror}" + (f" ({cause.filename})" if cause.filename else "")
    if isinstance(cause, pickle.UnpicklingError):  # torch's own words would suggest weights_only=False
        return f"rank {rank}: a shard holds a pickle that torch.load(weights_only=True) refuses: it may be planted"
    return f"rank {rank}: {str(cause).splitlines()[0][:200]}"


def damage(folder):
    """What is wrong with the sharded checkpoint `folder`, in a few words naming the file, or None; Planted
    where its .metadata would run code."""
    index = folder / ".metadata"
    if not index.is_file():
        return f"{index} is missing"
    try:
        pieces = metadata(folder).storage_data.values()
    except Planted:
        raise
    except Exception as err:  # truncated or foreign: unpickling raises a dozen kinds of error
        return f"{index} cannot be read ({type(err).__name__})"
    ends = {}
    for piece in pieces:  # each piece of a tensor lies in one file, at an offset, with a length
        ends[piece.relative_path] = max(ends.get(piece.relative_path, 0), piece.offset + piece.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < end:
            return f"{file} is truncated ({file.stat().st_size} of at least {end} bytes)"
    return None


class Planted(Exception):
    """A file of a checkpoint that loading would let run code, which no run of this repository writes: its
    message names the file and what it would run."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what DCP's metadata is made of and nothing else: find_class is the only way a pickle reaches
    a callable, and it refuses every name but these. Not BytesStorageMetadata either, the entry of an item
    that is not a tensor, which DCP loads with torch.load(weights_only=False): our saves write none (the
    optimizer's param_groups go to state.pt), so no item of a shard is ever unpickled but as a tensor, by
    torch.load(weights_only=True). Loading such items with weights_only=True instead would take a load
    planner of our own, built on DCP's private helpers."""

    def __init__(self, file):
        from pathlib import PosixPath  # the folder saved to, as a StorageMeta records it

        from torch.distributed.checkpoint import filesystem  # here: the stages that do not shard skip the import
        from torch.distributed.checkpoint import metadata as dcp

        super().__init__(file)
        self.file = file.name
        kinds = (dcp.Metadata, dcp.TensorStorageMetadata, dcp.ChunkStorageMetadata, dcp.MetadataIndex,
                 dcp.TensorProperties, dcp._MEM_FORMAT_ENCODING, dcp.StorageMeta, filesystem._StorageInfo,
                 torch.Size, PosixPath)  # fmt: skip
        self.admitted = {(kind.__module__, kind.__qualname__) for kind in kinds} | {("pathlib", "PosixPath")}
        self.admitted |= {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
        self.admitted.add(("torch.serialization", "_get_layout"))  # a layout, from its name ("torch.strided")

    def find_class(self, module, name):
        if (module, name) in self.admitted:
            return super().find_class(module, name)
        bytes_item = name == "BytesStorageMetadata"
        what = "an item torch would unpickle" if bytes_item else f"{module}.{name}, which loading would call"
        raise Planted(f"{self.file} is not a checkpoint this repository wrote (it names {what}): it may be planted")


def metadata(folder):
    """The metadata of the sharded checkpoint `folder`, read with _MetadataUnpickler; Planted where the file
    names anything else. DCP's own FileSystemReader reads it with pickle.load, which calls whatever the file
    names: a .metadata planted in a shared folder would run on every rank at the next resume, which a requeue
    or a torchrun restart starts by itself, and one that wraps the real metadata would leave no trace."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(folder / ".metadata", "rb") as f:
        found = _MetadataUnpickler(f).load()
    if not isinstance(found, Metadata):
        raise Planted(f"{folder / '.metadata'} is not a checkpoint this repository wrote (it holds a "
                      f"{type(found).__name__}): it may be planted")  # fmt: skip
    return found


def reader(folder):
    """DCP's reader of `folder` for torch.distributed.checkpoint.load, but reading .metadata with metadata():
    on every rank, so that a file swapped in since rank 0 checked the folder runs nothing either."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self):
            return metadata(folder)

    return Reader(folder)
