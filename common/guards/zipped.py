"""Guard rail: the zip layer of a torch.save file, read from its headers alone (common/guards/bounded.py reads
the pickle inside). A zip declares where its records lie and how large they are; zipfile and torch believe it.
Here a record is refused where it is compressed (torch would inflate it in memory: torch.save writes none),
named twice, or reaches past the file or into another record, and the central directory where it is larger than
DIRECTORY or not where its end record says."""

import io
import struct
import zipfile

DIRECTORY = 16 * 2**20  # a checkpoint of 10^4 tensors needs 2 MiB


class Refused(Exception):
    """A file whose contents are not what it declares, or would take far more memory than its size: the
    message names the file and what is wrong."""


class Window(io.RawIOBase):
    """`length` bytes of the open file `f` from `start`, as a file of its own: one piece of a DCP shard."""

    def __init__(self, f, start, length):
        super().__init__()
        self.f, self.start, self.length, self.at = f, start, length, 0

    def seek(self, offset, whence=0):
        self.at = max(0, (0, self.at, self.length)[whence] + offset)
        return self.at

    def tell(self):
        return self.at

    def readinto(self, buffer):
        self.f.seek(self.start + self.at)
        count = self.f.readinto(memoryview(buffer)[: max(0, min(len(buffer), self.length - self.at))])
        self.at += count
        return count


def directory(f, path, length):
    """{record name: (where its data starts, its size)} of the zip `f` and the name of its top folder; Refused
    where a record is compressed, named twice, or reaches past the file or into another record."""
    entries, size, offset = end_record(f, path, length)
    if size > DIRECTORY or entries > DIRECTORY // 46:  # 46 bytes: the smallest entry of a central directory
        raise Refused(f"{path} declares a zip directory of {entries} records in {size} bytes: too large")
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise Refused(f"{path} is not a zip archive torch can read ({err})") from None
    records, end = {}, 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        f.seek(info.header_offset)
        head = f.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise Refused(f"{path}: the record {info.filename} does not start where the zip directory says")
        start = info.header_offset + 30 + sum(struct.unpack("<HH", head[26:30]))
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise Refused(
                f"{path} holds a compressed record ({info.filename}), which torch would inflate in "
                "memory: torch.save writes none"
            )
        if info.filename in records:
            raise Refused(f"{path} holds two records named {info.filename}")
        if info.header_offset < end or start + info.file_size > offset:
            raise Refused(f"{path}: the record {info.filename} overlaps another, or reaches past the file")
        records[info.filename], end = (start, info.file_size), start + info.file_size
    return records, (infos[0].filename.split("/")[0] if infos else "")


def end_record(f, path, length):
    """(records, size, offset) of the zip's central directory, as its end record (zip64's too) declares."""
    f.seek(max(0, length - 65557))  # the end record (22 bytes) and a comment of up to 65535 bytes
    tail_start, tail = f.tell(), f.read()
    at = len(tail) - 22 if tail[-22:-18] == b"PK\x05\x06" else tail.rfind(b"PK\x05\x06")  # as zipfile finds it
    if at < 0 or len(tail) < at + 22:
        raise Refused(f"{path} is not a complete zip archive (no end record): it may be truncated")
    entries, size, offset = struct.unpack("<6xHLL", tail[at + 4 : at + 20])
    where = tail_start + at  # the directory ends where the end record starts, as torch.save writes it
    locator = tail[at - 20 : at] if at >= 20 else b""
    if locator[:4] == b"PK\x06\x07":  # zip64 (torch.save writes it always): its own end record says
        where = struct.unpack("<8xQ", locator[:16])[0]
        f.seek(where)
        record = f.read(56)
        if record[:4] != b"PK\x06\x06" or len(record) < 56:
            raise Refused(f"{path} is not a zip archive torch can read (its zip64 end record is missing)")
        entries, size, offset = struct.unpack("<32xQQQ", record)
    if offset + size != where:
        raise Refused(f"{path}: its zip directory is not where its end record says")
    return entries, size, offset
