"""Guard rail: nothing in a checkpoint folder runs code. torch.distributed.checkpoint (stage 05's sharded
checkpoints) unpickles a folder's .metadata with pickle.load, which calls whatever the file names: a .metadata
planted in a shared folder would run on every rank at the next resume, which a requeue or a torchrun restart
starts by itself. The lesson reads it with an unpickler that builds DCP's metadata classes and nothing else
(common/shards.py); here rank 0 checks the whole folder with it before any rank loads (damage())."""

import io
import pickle
import pickletools

from common import shards
from common.guards.bounded import PICKLE, Refused, regular, torch_file
from common.shards import Planted

METADATA = 64 * 2**20  # .metadata of 10^3 tensors in 64 shards: 15 MiB; unpickled, it takes several times its size


def metadata(folder):
    """The metadata of the sharded checkpoint `folder`, read with the lesson's IndexUnpickler (common/shards.py),
    within a size; Planted where the file names anything else. DCP's own FileSystemReader reads it with pickle.load, which calls whatever the file
    names: a .metadata planted in a shared folder would run on every rank at the next resume, which a requeue
    or a torchrun restart starts by itself, and one that wraps the real metadata would leave no trace."""
    from torch.distributed.checkpoint.metadata import Metadata

    if regular(folder / ".metadata") > METADATA:
        raise Refused(
            f"{folder / '.metadata'} is larger than {METADATA // 2**20} MiB: no checkpoint of these stages "
            "has so many tensors"
        )
    found = shards.index(folder)
    if not isinstance(found, Metadata):
        raise Planted(
            f"{folder / '.metadata'} is not a checkpoint this repository wrote (it holds a "
            f"{type(found).__name__}): it may be planted"
        )
    return found


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
    except Refused as err:
        return str(err)
    except Exception as err:  # truncated or foreign: unpickling raises a dozen kinds of error
        return f"{index} cannot be read ({type(err).__name__})"
    ends = {}
    for piece in pieces:  # each piece of a tensor lies in one file, at an offset, with a length
        if not (type(piece.offset) is type(piece.length) is int and piece.offset >= 0 and piece.length >= 0):
            return f"{index} declares a piece of {piece.relative_path} at byte {piece.offset}, {piece.length} long"
        ends[piece.relative_path] = max(ends.get(piece.relative_path, 0), piece.offset + piece.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < end:
            return f"{file} is truncated ({file.stat().st_size} of at least {end} bytes)"
    for piece in pieces:  # each piece a torch.save file of its own: checked as checkpoint.pt is, headers only
        file = folder / piece.relative_path
        if getattr(piece, "transform_descriptors", None):  # newer torch: a piece DCP would decompress first
            return f"{file} holds a compressed piece ({str(piece.transform_descriptors)[:80]}): our saves write none"
        try:
            torch_file(file, piece.offset, piece.length)
        except Refused as err:
            return f"{err} (the piece at byte {piece.offset})"
    return None


def tensors(folder):
    """{name: (dtype, shape)} of each tensor the sharded checkpoint `folder` lists (its .metadata, read as
    metadata() reads it), as the model's are declared (recorded.declared()): DCP would load a float64 or int64
    tensor into a float32 parameter, cast, where it is listed under its name."""
    listed = metadata(folder).state_dict_metadata.items()
    return {name: (str(item.properties.dtype), tuple(item.size)) for name, item in listed if hasattr(item, "size")}


def first(err):
    """The first rank's failure a torch.distributed.checkpoint save or load raised (a CheckpointException, which
    every rank gets), else `err`."""
    return next(iter(err.failures.values()))[0] if getattr(err, "failures", None) else err


def describe(err):
    """The first failure of a torch.distributed.checkpoint save or load, in a few words: which rank, what."""
    rank, (cause, _) = next(iter(err.failures.items())) if hasattr(err, "failures") else ("?", (err, None))
    if isinstance(cause, OSError) and cause.strerror:
        return f"rank {rank}: {cause.strerror}" + (f" ({cause.filename})" if cause.filename else "")
    if isinstance(cause, Planted):  # a .metadata that names something to call: the file, and what it names
        return f"rank {rank}: {cause}"
    if isinstance(cause, pickle.UnpicklingError):  # torch's own words would suggest weights_only=False
        return f"rank {rank}: a shard holds a pickle that torch.load(weights_only=True) refuses: it may be planted"
    return f"rank {rank}: {str(cause).splitlines()[0][:200]}"


def calls(file):
    """Does `file` read as a pickle that names something to call (read by pickletools, which runs nothing)?"""
    try:
        with open(file, "rb") as f:  # read within PICKLE: a declared length is not trusted either
            ops = pickletools.genops(io.BytesIO(f.read(PICKLE)))
            return any(op.name in ("GLOBAL", "STACK_GLOBAL", "INST", "OBJ") for op, _, _ in ops)
    except Exception:  # no pickle at all
        return False
