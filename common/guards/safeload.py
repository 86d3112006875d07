"""Guard rail: nothing in a checkpoint folder runs code. torch.distributed.checkpoint (stage 05's sharded
checkpoints) unpickles a folder's .metadata with pickle.load, which calls whatever the file names: a .metadata
planted in a shared folder would run on every rank at the next resume, which a requeue or a torchrun restart
starts by itself. Here it is read by an unpickler that builds DCP's metadata classes and nothing else, in rank
0's check of the folder (damage()) and in every rank's load (reader())."""

import pickle

import torch

from common.guards.bounded import Refused, regular, torch_file

METADATA = 64 * 2**20  # .metadata of 10^3 tensors in 64 shards: 15 MiB; unpickled, it takes several times its size


class Planted(Exception):
    """A file of a checkpoint that loading would let run code, which no run of this repository writes: its
    message names the file and what it would run."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what DCP's metadata is made of and nothing else: find_class is the only way a pickle reaches
    a callable, and it refuses every name but these. Not BytesStorageMetadata either, the entry of an item
    that is not a tensor, which DCP would unpickle unrestricted: our saves write none (the
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

    if regular(folder / ".metadata") > METADATA:
        raise Refused(f"{folder / '.metadata'} is larger than {METADATA // 2**20} MiB: no checkpoint of these stages "
                      "has so many tensors")  # fmt: skip
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


def describe(err):
    """The first failure of a torch.distributed.checkpoint save or load, in a few words: which rank, what."""
    rank, (cause, _) = next(iter(err.failures.items())) if hasattr(err, "failures") else ("?", (err, None))
    if isinstance(cause, OSError) and cause.strerror:
        return f"rank {rank}: {cause.strerror}" + (f" ({cause.filename})" if cause.filename else "")
    if isinstance(cause, pickle.UnpicklingError):  # torch's own words would suggest weights_only=False
        return f"rank {rank}: a shard holds a pickle that torch.load(weights_only=True) refuses: it may be planted"
    return f"rank {rank}: {str(cause).splitlines()[0][:200]}"
