"""A file is checked against what it declares before it is trusted (common/guards/bounded.py): each hostile
file is refused in one line naming it, by reading its headers only, before torch (or a parser) allocates
what the file declares; the memory of the process that refuses it stays small."""

import collections
import io
import json
import os
import pickle
import struct
import sys
import types
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from helpers import REPO, S01, clean_env, one_error, run, stage_args

from common.guards import bounded, resume, safeload

sys.path.insert(0, str(REPO / "tools"))
import plan  # noqa: E402
import plot  # noqa: E402
import scaling  # noqa: E402

MIB = 2**20


class Ref:
    """A storage as torch.save names it in data.pkl: (its kind, its record's key, its element count)."""

    def __init__(self, kind, key, numel):
        self.kind, self.key, self.numel = kind, key, numel


class View:
    """A tensor as torch.save writes it: its storage, offset, size and stride, rebuilt by torch._utils."""

    def __init__(self, ref, offset, size, stride):
        self.args = (ref, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", obj.kind, obj.key, "cpu", obj.numel) if isinstance(obj, Ref) else None


def craft(path, obj, records, compress=zipfile.ZIP_STORED):
    """A file in torch.save's format holding `obj` (Refs and Views in it) and `records` {key: bytes}."""
    pickled = io.BytesIO()
    TorchPickler(pickled, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", compress) as z:
        z.writestr("archive/data.pkl", pickled.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, data in records.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")
    return path


def refused(path, *words, monkeypatch):
    """The guard rails' read of the checkpoint `path` refuses it, naming it and `words`, before torch.load."""
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load reached"))
    with pytest.raises((resume.Unusable, resume.Planted)) as caught:
        resume.load(path)
    for word in (str(path), *words):
        assert word in str(caught.value), caught.value
    return str(caught.value)


def test_a_small_view_of_a_tensor_and_every_kind_the_stages_write_pass(tmp_path):
    flat = torch.arange(10.0)
    state = {"epoch": 1, "run": {"flags": {}}, "model": torch.nn.Linear(3, 4).state_dict(), "view": flat[2:5],
             "t": torch.ones(3, 2).t(), "empty": torch.empty(0, 5), "scalar": torch.tensor(3.0),
             "bf16": torch.ones(3, dtype=torch.bfloat16), "rng": torch.get_rng_state(), "p": torch.nn.Parameter(flat)}  # fmt: skip
    torch.save(state, tmp_path / "ok.pt")
    assert resume.load(tmp_path / "ok.pt")["epoch"] == 1


def test_a_deflated_record_is_refused(tmp_path, monkeypatch):
    craft(tmp_path / "c.pt", {"w": View(Ref(torch.FloatStorage, "0", 4), 0, (4,), (1,))}, {"0": bytes(16)},
          compress=zipfile.ZIP_DEFLATED)  # fmt: skip
    refused(tmp_path / "c.pt", "compressed record", monkeypatch=monkeypatch)


def test_a_stride_zero_view_larger_than_its_storage_is_refused(tmp_path, monkeypatch):
    """torch.save's own file of an 8-byte storage expanded to 2^28 elements: weights_only loads it."""
    huge = torch.ones(2)[:1].expand(2**28)
    torch.save({"epoch": 1, "run": {}, "model": {}, "optimizer": {"state": {0: {"exp_avg": huge}}}}, tmp_path / "c.pt")
    refused(tmp_path / "c.pt", "268435456 elements", "stride (0,)", "storage of 8 bytes", monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    "size, stride, words",
    [
        ((2**28,), (1,), "declares more than it holds"),  # torch.set_ would grow the storage to 1 GiB
        ((2, 2), (1, 0), "declares more than it holds"),  # 4 elements over 2: a view that repeats them
        ((2,), (-1,), "stride (-1,)"),
        ((-1,), (1,), "size (-1,)"),
        ((2,), (1, 1), "size (2,) and stride (1, 1)"),
    ],
)
def test_a_tensor_whose_extent_exceeds_its_storage_is_refused(tmp_path, monkeypatch, size, stride, words):
    craft(tmp_path / "c.pt", {"w": View(Ref(torch.FloatStorage, "0", 2), 0, size, stride)}, {"0": bytes(8)})
    refused(tmp_path / "c.pt", words, monkeypatch=monkeypatch)


def test_a_storage_of_the_wrong_dtype_or_a_huge_declared_size_is_refused(tmp_path, monkeypatch):
    craft(tmp_path / "c.pt", {"w": View(Ref(torch.DoubleStorage, "0", 2), 0, (2,), (1,))}, {"0": bytes(8)})
    refused(tmp_path / "c.pt", "2 elements of 8 bytes", "holds 8 bytes", monkeypatch=monkeypatch)
    craft(tmp_path / "d.pt", {"w": View(Ref(torch.FloatStorage, "0", 2**40), 0, (2,), (1,))}, {"0": bytes(8)})
    refused(tmp_path / "d.pt", f"{2**40} elements", monkeypatch=monkeypatch)


def test_scaling_refuses_a_checkpoint_that_declares_more_than_it_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load reached"))
    torch.save({"run": {"flags": {}}, "x": torch.ones(2)[:1].expand(2**28)}, tmp_path / "checkpoint.pt")
    with pytest.raises(SystemExit, match=f"^error: {tmp_path / 'checkpoint.pt'} is not a checkpoint .*stride"):
        scaling.recorded(tmp_path)


def test_deep_nesting_and_a_loop_are_refused(tmp_path, monkeypatch):
    deep = []
    for _ in range(bounded.DEPTH + 1):
        deep = [deep]
    torch.save({"epoch": 1, "x": deep}, tmp_path / "deep.pt")
    refused(tmp_path / "deep.pt", "nests deeper", monkeypatch=monkeypatch)
    loop = []
    loop.append(loop)  # the pickle's memo makes the list hold itself
    torch.save({"epoch": 1, "x": loop}, tmp_path / "loop.pt")
    refused(tmp_path / "loop.pt", "holds itself", monkeypatch=monkeypatch)


def test_two_records_of_one_name_or_overlapping_records_are_refused(tmp_path, monkeypatch):
    craft(tmp_path / "c.pt", {"w": View(Ref(torch.FloatStorage, "0", 2), 0, (2,), (1,))}, {"0": bytes(8)})
    with zipfile.ZipFile(tmp_path / "c.pt", "a") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("archive/data/0", bytes(2**10))  # zipfile would read this one, torch the first
    refused(tmp_path / "c.pt", "two records named archive/data/0", monkeypatch=monkeypatch)
    torch.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "o.pt")
    data = bytearray((tmp_path / "o.pt").read_bytes())
    first = zipfile.ZipFile(tmp_path / "o.pt").getinfo("o/data/0").header_offset
    entry = data.index(b"PK\x01\x02")  # the central directory's entries, until that of o/data/1
    while not data[entry + 46 :].startswith(b"o/data/1"):
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 42 : entry + 46] = struct.pack("<L", first)  # its record's offset: that of o/data/0
    (tmp_path / "o.pt").write_bytes(data)
    refused(tmp_path / "o.pt", "overlaps another", monkeypatch=monkeypatch)


def test_a_huge_zip_directory_or_data_pkl_is_refused(tmp_path, monkeypatch):
    torch.save({"a": torch.ones(2)}, tmp_path / "c.pt")
    data = bytearray((tmp_path / "c.pt").read_bytes())
    at = data.rindex(b"PK\x06\x06")  # zip64's end record: the directory's size
    data[at + 40 : at + 48] = struct.pack("<Q", 2**40)
    (tmp_path / "c.pt").write_bytes(data)
    refused(tmp_path / "c.pt", "zip directory", monkeypatch=monkeypatch)
    craft(tmp_path / "p.pt", {"x": "a" * (bounded.PICKLE + 1)}, {})
    refused(tmp_path / "p.pt", "data.pkl of 16 MiB", monkeypatch=monkeypatch)


def deflated(path, inflated):
    """A checkpoint.pt whose storage record is `inflated` bytes of zeros deflated: a few MiB on disk."""
    torch.save({"epoch": 1, "run": {}, "model": {"w": torch.zeros(1)}}, path)
    block = zlib.compressobj(1, zlib.DEFLATED, -15)
    first = block.compress(bytes(MIB)) + block.flush(zlib.Z_FULL_FLUSH)
    again = block.compress(bytes(MIB)) + block.flush(zlib.Z_FULL_FLUSH)  # the same bytes: no history is used
    stream = first + again * (inflated // MIB - 1) + block.flush()
    crc = 0
    for _ in range(inflated // MIB):
        crc = zlib.crc32(bytes(MIB), crc)
    src = zipfile.ZipFile(path)
    records = {i.filename: src.read(i) for i in src.infolist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records.items():
            if name.endswith("data/0"):
                info = zipfile.ZipInfo(name)
                info.compress_type = zipfile.ZIP_DEFLATED
                with z.open(info, "w", force_zip64=True) as f:
                    f._compressor = None  # write the deflated stream as it is: zipfile's own would take minutes
                    f._fileobj.write(stream)
                    f._compress_size, f._file_size, f._crc = len(stream), inflated, crc
            else:
                z.writestr(name, data)
    path.write_bytes(out.getvalue())
    return path


def peak(*cmd):
    """Run `cmd`: (its result, the most memory it held, in MiB). Measured by a small process that starts it:
    Linux keeps a forked process's peak, the pytest worker's here, across exec."""
    measure = ("import resource, subprocess, sys; status = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(status)")  # fmt: skip
    out = run([sys.executable, "-c", measure, sys.executable, *map(str, cmd)], env=clean_env())
    return out, int(out.stdout.split()[-1]) // 1024


@pytest.mark.slow
def test_a_stage_resuming_a_deflated_checkpoint_refuses_it_in_one_line_with_little_memory(tiny_data, tmp_path):
    """Stage 01 --resume to a 1 GiB storage deflated into a few MiB: torch would inflate it whole."""
    evil = deflated(tmp_path / "evil.pt", 2**30)
    assert evil.stat().st_size < 8 * MIB
    out, mib = peak(S01, *stage_args(tiny_data, tmp_path / "out", "--resume", evil))
    line = one_error(out, str(evil), "compressed record", "resume from another checkpoint")
    assert "delete" not in line  # a file --resume names outside the run's folder is the user's
    assert mib < 1280, mib  # a stage refusing any --resume peaks near 800 MiB here; inflated, 1 GiB more


def test_a_refused_checkpoint_costs_little_memory(tmp_path):
    """The check alone, on the same file: the few MiB of its headers."""
    check = (
        "import sys; from pathlib import Path; from common.guards import bounded; bounded.torch_file(Path(sys.argv[1]))"
    )
    out, mib = peak("-c", check, deflated(tmp_path / "evil.pt", 2**30))
    assert "compressed record" in out.stderr.splitlines()[-1] and mib < 100, (mib, out.stderr)


def sharded(folder, piece, **info):
    """A stage 05 folder whose .metadata lists one piece, `piece` (the bytes of a torch.save), in __0_0.distcp."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(piece)
    stored = _StorageInfo("__0_0.distcp", info.pop("offset", 0), info.pop("length", len(piece)), **info)
    index = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("model.w", (0,)): stored})
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    return folder


def test_a_sharded_checkpoints_pieces_are_checked_against_their_files(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    good = io.BytesIO()
    torch.save(torch.ones(3), good)
    assert safeload.damage(sharded(tmp_path / "good", good.getvalue())) is None
    huge = io.BytesIO()
    torch.save(torch.ones(2)[:1].expand(2**28), huge)
    assert "declares more than it holds" in safeload.damage(sharded(tmp_path / "huge", huge.getvalue()))
    deflating = tmp_path / "deflated.pt"
    craft(deflating, View(Ref(torch.FloatStorage, "0", 4), 0, (4,), (1,)), {"0": bytes(16)}, zipfile.ZIP_DEFLATED)
    assert "compressed record" in safeload.damage(sharded(tmp_path / "deflated", deflating.read_bytes()))
    if hasattr(_StorageInfo, "transform_descriptors"):  # torch >= 2.8: pieces DCP decompresses
        zstd = sharded(tmp_path / "zstd", good.getvalue(), transform_descriptors=["zstandard"])
        assert "compressed piece" in safeload.damage(zstd)
    negative = sharded(tmp_path / "negative", good.getvalue(), offset=-5)
    assert "at byte -5" in safeload.damage(negative)
    big = sharded(tmp_path / "big", good.getvalue())
    with open(big / ".metadata", "r+b") as f:
        f.truncate(safeload.METADATA + 1)  # sparse: no disk
    assert "larger than 64 MiB" in safeload.damage(big)


def test_a_huge_metrics_csv_or_one_with_too_many_columns_is_refused_before_parsing(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,world_size\n" + "1,1\n" * (plot.LIMITS[0] // 4))
    with pytest.raises(SystemExit, match="larger than 4 MiB") as caught:
        plot.load(tmp_path)
    assert str(caught.value).startswith(f"error: {tmp_path / 'metrics.csv'}")
    (tmp_path / "metrics.csv").write_text(",".join(map(str, range(10**5))) + "\n")
    with pytest.raises(SystemExit, match="100000 columns"):
        plot.load(tmp_path)
    header = ",".join(sorted(plot.COLUMNS | {"test_accuracy"}))
    (tmp_path / "metrics.csv").write_text(f"{header}\n" + "1" * (3 * MIB) + ",1,1,1,1\n")  # one huge line
    with pytest.raises(SystemExit, match="^error: .*line 2: field larger than field limit"):
        plot.load(tmp_path)


def test_a_huge_or_deeply_nested_doctor_json_is_refused_before_parsing(tmp_path):
    args = types.SimpleNamespace(bandwidth=None, doctor=str(tmp_path / "doctor.json"))
    with open(tmp_path / "doctor.json", "wb") as f:
        f.truncate(17 * MIB)  # sparse: no disk
    with pytest.raises(SystemExit, match=f"^error: --doctor {tmp_path / 'doctor.json'} is larger than 16 MiB"):
        plan.bandwidth(args)
    (tmp_path / "doctor.json").write_text(json.dumps({"ranks": 1}).replace("1", "[" * 10**6 + "]" * 10**6))
    with pytest.raises(SystemExit, match="^error: --doctor .* nests deeper"):
        plan.bandwidth(args)


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(bounded.Refused, match="not a regular file"):
        bounded.text(Path(tmp_path / "fifo"))
