"""Stage 05's checkpoint folders, read without running what they name.

torch.distributed.checkpoint (DCP) reads a folder's index, .metadata, with pickle.load, which calls
whatever the file names: a .metadata planted in a shared folder would run on every rank at the next
resume, and a requeue or a torchrun restart starts one by itself. reader() hands DCP the index read
by an unpickler that builds DCP's metadata classes and nothing else; every tensor is read by
torch.load(weights_only=True) as it is.
"""

import pickle


class Planted(pickle.UnpicklingError):
    """A checkpoint file that loading would let run code (no run of these stages writes one): its
    message names the file and what it would run."""


class IndexUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else: find_class, a pickle's only way to a callable,
    refuses every other name; BytesStorageMetadata too, an item that is no tensor, which DCP would
    unpickle unrestricted (the stages write none: param_groups go to state.pt)."""

    def __init__(self, file):
        from pathlib import PosixPath  # the folder saved to, as a StorageMeta records it

        import torch
        from torch.distributed.checkpoint import filesystem
        from torch.distributed.checkpoint import metadata as dcp

        super().__init__(file)
        self.file = file.name
        kinds = (
            dcp.Metadata,
            dcp.TensorStorageMetadata,
            dcp.ChunkStorageMetadata,
            dcp.MetadataIndex,
            dcp.TensorProperties,
            dcp._MEM_FORMAT_ENCODING,
            dcp.StorageMeta,
            filesystem._StorageInfo,
            torch.Size,
            PosixPath,
        )
        self.admitted = {(kind.__module__, kind.__qualname__) for kind in kinds}
        self.admitted.add(("pathlib", "PosixPath"))
        dtypes = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
        self.admitted |= {("torch", name) for name in dtypes}
        self.admitted.add(("torch.serialization", "_get_layout"))  # a layout, from its name

    def find_class(self, module, name):
        if (module, name) in self.admitted:
            return super().find_class(module, name)
        what = f"{module}.{name}, which loading would call"
        if name == "BytesStorageMetadata":
            what = "an item torch would unpickle"
        raise Planted(
            f"{self.file} is not a checkpoint this repository wrote (it names {what}): "
            "it may be planted"
        )


def index(folder):
    """The metadata of the checkpoint folder `folder`, read with IndexUnpickler."""
    with open(folder / ".metadata", "rb") as f:
        return IndexUnpickler(f).load()


def reader(folder):
    """DCP's reader of `folder` for torch.distributed.checkpoint.load: .metadata read by index()."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return index(folder)

    return Reader(folder)
