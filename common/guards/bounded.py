"""Guard rail: a file is checked against what it declares before it is trusted. torch.load trusts a file's
declared sizes: a 2 MiB checkpoint holding a deflated record inflates to 2 GiB, and a tensor may claim more
elements than its storage holds (8 bytes viewed as 2^28 elements with stride 0, or with stride 1, which torch
answers by growing the storage). So before torch reads a checkpoint.pt, checkpoint-previous.pt, state.pt, a
stage 05 shard's pieces or a --save-model file (torch_file()), and before the tools parse a metrics.csv or a
doctor.json (text()), the file's headers are read, never its data: memory stays within a few times the
limits below, whatever the file claims.

torch.save writes a zip of stored (uncompressed) records: a pickle, data.pkl, and one record per storage. A
file is refused, in words naming it, where its zip layer is not what it declares (common/guards/zipped.py:
a record compressed, named twice, reaching past the file or into another); where data.pkl is larger than PICKLE
or names a storage whose record does not hold its declared bytes; where a tensor's elements are more than its
storage holds, its extent reaches past it, or a size or stride is negative; where the pickle nests deeper
than DEPTH (a loop nests for ever) or calls one of torch's tensor rebuilds the stages never write. The pickle
is read by an unpickler whose every callable is a stand-in of this module: nothing the file names runs, and
torch.load(weights_only=True) still decides afterwards what may be built. tests/test_bounded.py proves each
case, a stage run with --resume to a crafted file included."""

import errno
import io
import os
import pickle
import stat

from common.guards.zipped import Refused, Window, directory

PICKLE, DEPTH = 16 * 2**20, 32  # a checkpoint of 10^4 tensors needs 2 MiB of data.pkl
TENSORS = ("_rebuild_tensor_v2", "_rebuild_tensor_v3")  # how torch.save writes a tensor on a storage
WRAPS = ("_rebuild_parameter", "_rebuild_parameter_with_state")  # around a tensor built by one of those


def regular_file(path):
    """`path`, unless reading it could block or never end (a FIFO, a socket, a device): OSError. The one check
    of every path a run reads: the task file (check.task_file()), data files, checkpoints, a task's modules."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        why = "not a regular file (a FIFO or a device: reading it would block)"
        raise OSError(errno.EINVAL, why, str(path))
    return path


def regular(path):
    """The size of `path`, a regular file; Refused where it is none (a FIFO or a device never ends)."""
    try:
        info = os.stat(regular_file(path))
    except OSError as err:  # regular_file()'s EINVAL: a FIFO, a socket or a device
        nonregular = err.errno == errno.EINVAL
        why = " is not a regular file (a FIFO, a socket or a device)" if nonregular else f": {err.strerror}"
        raise Refused(f"{path}{why}") from None
    if stat.S_ISDIR(info.st_mode):
        raise Refused(f"{path}: {os.strerror(errno.EISDIR)}")
    return info.st_size


def text(path, limit=16 * 2**20):
    """The text of a small file the tools read (metrics.csv, doctor.json), read whole only within `limit`
    bytes: a run writes a few kB, and a parser holds several times what it reads."""
    size = regular(path)
    with open(path, "rb") as f:
        raw = f.read(limit + 1)  # within the limit, whatever the file has grown to since
    if max(size, len(raw)) > limit:
        raise Refused(f"{path} is larger than {limit // 2**20} MiB, far more than a run writes")
    return raw.decode("utf-8-sig")  # a byte order mark, as a spreadsheet saves UTF-8, is none of the text


def torch_file(path, start=0, length=None):
    """Check the torch.save file `path` (or its `length` bytes from `start`) against what it declares, reading
    its headers only; Refused saying what is wrong. A file that is no zip is left to the caller (torch would
    read it in its legacy format, which declares sizes it allocates before reading: the stages refuse it)."""
    length = regular(path) - start if length is None else length
    with open(path, "rb") as raw:
        f = Window(raw, start, length)
        if f.read(4) != b"PK\x03\x04":  # how torch.load tells its zip format from the legacy one
            raise Refused(f"{path} is not in torch.save's zip format")
        records, prefix = directory(f, path, length)
        data = records.get(f"{prefix}/data.pkl")
        if data is None or data[1] > PICKLE:
            what = "no data.pkl record" if data is None else f"a data.pkl of {data[1] // 2**20} MiB"
            raise Refused(f"{path} holds {what}, which no checkpoint of these stages has")
        f.seek(data[0])
        try:
            found = _Unpickler(io.BytesIO(f.read(data[1])), path, prefix, records).load()
        except Refused:
            raise
        except Exception as err:  # cut short, or calls with the wrong arguments: a dozen kinds of error
            raise Refused(f"{path}: its data.pkl is no pickle torch.save writes ({type(err).__name__})") from None
    nesting(found, path)


class _Kind:
    def __init__(self, itemsize):
        self.itemsize = itemsize


class _Storage:
    def __init__(self, bytes, itemsize):
        self.bytes, self.itemsize = bytes, itemsize


class _Stand:
    """What every other callable a pickle names becomes: it keeps what it is given, for nesting(), and runs
    nothing (torch.load refuses the names it does not allow, later)."""

    def __init__(self, *args, **kwargs):
        self.parts = [args, kwargs]

    def __setstate__(self, state):
        self.parts.append(state)

    def __setitem__(self, key, value):
        self.parts.append((key, value))

    append = extend = __setstate__


class _Unpickler(pickle.Unpickler):
    """Reads data.pkl building stand-ins only: storages as their record's size, tensors checked against them."""

    def __init__(self, file, path, prefix, records):
        import torch  # here: the tools that read only text (metrics.csv, doctor.json) skip the import

        super().__init__(file)
        self.path, self.prefix, self.records, self.torch = path, prefix, records, torch

    def find_class(self, module, name):
        torch = self.torch
        kind = getattr(torch, name, None) if module == "torch" else None
        if isinstance(kind, torch.dtype):
            return kind
        if isinstance(kind, type) and issubclass(kind, (torch.storage.TypedStorage, torch.UntypedStorage)):
            itemsize = 1 if kind is torch.UntypedStorage else getattr(getattr(kind, "_dtype", None), "itemsize", 0)
            return _Kind(itemsize)  # FloatStorage and the like: the size of their elements
        if module == "torch._utils" and name in TENSORS:
            return self.tensor
        if module == "torch._utils" and name.startswith("_rebuild") and name not in WRAPS:
            raise Refused(f"{self.path} holds a tensor of a kind these stages never write ({module}.{name})")
        return _Stand

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Kind)):
            raise Refused(f"{self.path} names a storage torch.save never writes ({str(pid)[:80]})")
        _, kind, key, _, numel = pid
        record = self.records.get(f"{self.prefix}/data/{key}")
        if record is None or type(numel) is not int or kind.itemsize < 1 or record[1] != numel * kind.itemsize:
            raise Refused(
                f"{self.path} declares a storage {key} of {numel} elements of {kind.itemsize} bytes, "
                f"where its record holds {record[1] if record else 'no'} bytes"
            )
        return _Storage(record[1], kind.itemsize)

    def tensor(self, storage, offset, size, stride, *rest):
        if not isinstance(storage, _Storage):
            raise Refused(f"{self.path} holds a tensor without a storage")
        dtype = rest[2] if len(rest) > 2 else None  # _rebuild_tensor_v3's, on an untyped storage
        itemsize = dtype.itemsize if isinstance(dtype, self.torch.dtype) else storage.itemsize
        numbers = [offset, *size, *stride] if isinstance(size, tuple) and isinstance(stride, tuple) else [None]
        if len(size or ()) != len(stride or ()) or not all(type(n) is int and n >= 0 for n in numbers):
            raise Refused(f"{self.path} holds a tensor of size {size} and stride {stride}: torch.save writes none")
        elements = 1
        for n in size:
            elements *= n
        reach = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1 if elements else 0
        if elements * itemsize > storage.bytes or reach * itemsize > storage.bytes:
            raise Refused(
                f"{self.path} holds a tensor of {elements} elements (size {size}, stride {stride}) on a "
                f"storage of {storage.bytes} bytes: it declares more than it holds"
            )
        return _Stand(storage.bytes)


def nesting(found, path):
    """Refused where `found` nests deeper than DEPTH: level by level, each object once a level, so a loop
    (a list that holds itself) is refused too, in at most DEPTH passes."""
    level, containers = [found], (list, tuple, set, frozenset, dict, _Stand)
    for _ in range(DEPTH):
        inner = {}
        for thing in level:
            parts = thing.parts if isinstance(thing, _Stand) else thing
            if isinstance(parts, dict):
                parts = [*parts.keys(), *parts.values()]
            if isinstance(parts, list | tuple | set | frozenset):
                inner.update((id(p), p) for p in parts if isinstance(p, containers))
        if not inner:
            return
        level = list(inner.values())
    raise Refused(f"{path} nests deeper than {DEPTH} levels (or holds itself): no checkpoint of these stages does")
