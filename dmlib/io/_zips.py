"""One reading of a zip archive, whoever reads it: what the torch and npz readers check first.

A zip says where each member is twice: in the central directory at its end (what
Python's ``zipfile`` and torch's reader list) and in the local header before each
member's bytes (what a reader that walks the file, or seeks to a member, finds). Readers
differ in which copy they trust and in which of two members of one name they take:
torch's reader takes the first ``archive/data/0``, ``zipfile`` the last. A file that two
readers read differently can be called identical to a run that torch loads as
something else, so :func:`check` refuses, before any member is read:

- two members of one name;
- a local header that disagrees with its central-directory entry: its name, its
  compression method, its encryption or data-descriptor flags, or (where the local
  header states them) its CRC and sizes; a data descriptor after the member's bytes that
  disagrees with the CRC or sizes;
- an end record that places the central directory elsewhere than it is (bytes before
  the archive, which ``zipfile`` silently skips and other readers do not) or counts
  another number of members than the directory holds;
- members whose bytes overlap.

APPNOTE.TXT (PKWARE's zip specification) gives the layouts: local header 4.3.7, data
descriptor 4.3.9, zip64 extra field 4.5.3, end records 4.3.14-4.3.16.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable

from dmlib.errors import FormatError, LayoutError, TruncatedError

__all__ = ["check"]

_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # signature ... name length, extra length
_END = struct.Struct("<4sHHHHIIH")
_END64_LOCATOR = struct.Struct("<4sIQI")
_END64 = struct.Struct("<4sQHHIIQQQQ")
_FLAGS = 0x1 | 0x8  # encrypted, sizes in a data descriptor

Read = Callable[[int, int], bytes]  # (offset, length) -> at most length bytes of the file


def _end_record(read: Read, size: int) -> tuple[int, int] | None:
    """(members counted, central directory offset) the end record states, or None if absent."""
    tail_start = max(0, size - (_END.size + 0xFFFF))
    tail = read(tail_start, size - tail_start)
    at = tail.rfind(b"PK\x05\x06")
    while at >= 0:
        if at + _END.size <= len(tail):
            end = _END.unpack_from(tail, at)
            if at + _END.size + end[7] == len(tail):  # the comment runs to the end
                break
        at = tail.rfind(b"PK\x05\x06", 0, at)
    if at < 0:
        return None
    count, offset = end[4], end[6]
    pos = tail_start + at - _END64_LOCATOR.size
    if pos >= 0 and (count == 0xFFFF or offset == 0xFFFFFFFF):
        loc = read(pos, _END64_LOCATOR.size)
        if len(loc) == _END64_LOCATOR.size and loc[:4] == b"PK\x06\x07":
            rec = read(_END64_LOCATOR.unpack(loc)[2], _END64.size)
            if len(rec) == _END64.size and rec[:4] == b"PK\x06\x06":
                fields = _END64.unpack(rec)
                count, offset = fields[7], fields[9]
    return count, offset


def _zip64_sizes(extra: bytes) -> tuple[int | None, int | None]:
    """(uncompressed, compressed) sizes of a local header's zip64 extra field, where given."""
    pos = 0
    while pos + 4 <= len(extra):
        kind, n = struct.unpack_from("<HH", extra, pos)
        if kind == 1:
            body = extra[pos + 4 : pos + 4 + n]
            usize = struct.unpack_from("<Q", body, 0)[0] if len(body) >= 8 else None
            csize = struct.unpack_from("<Q", body, 8)[0] if len(body) >= 16 else None
            return usize, csize
        pos += 4 + n
    return None, None


def _local_problem(info: zipfile.ZipInfo, head: bytes, extra: bytes) -> str | None:
    """What member ``info``'s local header (``head``, its fixed part) says otherwise."""
    _, _, flags, method, _, _, crc, csize, usize, _, _ = _LOCAL.unpack(head)
    if method != info.compress_type:
        return f"it states compression method {method}, the directory {info.compress_type}"
    if flags & _FLAGS != info.flag_bits & _FLAGS:
        return f"it states flags {flags:#x}, the directory {info.flag_bits:#x}"
    if 0xFFFFFFFF in (csize, usize):
        z_usize, z_csize = _zip64_sizes(extra)
        usize = z_usize if usize == 0xFFFFFFFF and z_usize is not None else usize
        csize = z_csize if csize == 0xFFFFFFFF and z_csize is not None else csize
    stated = (crc, csize, usize)
    central = (info.CRC, info.compress_size, info.file_size)
    if flags & 0x8 and stated == (0, 0, 0):
        return None  # the values follow the data, in its descriptor
    if stated != central:
        return f"it states CRC and sizes {stated}, the directory {central}"
    return None


def _descriptor_problem(info: zipfile.ZipInfo, read: Read, end: int) -> str | None:
    """What the data descriptor after a member's bytes says otherwise (flag 0x8 only)."""
    raw = read(end, 24)
    if raw[:4] == b"PK\x07\x08":
        raw = raw[4:]
    want = (info.CRC, info.compress_size, info.file_size)
    if len(raw) >= 12 and struct.unpack_from("<III", raw) == want:
        return None
    if len(raw) >= 20 and struct.unpack_from("<IQQ", raw) == want:
        return None
    return "its data descriptor states another CRC or size"


def check(
    zf: zipfile.ZipFile, read: Read, size: int, what: str, path: str | None
) -> dict[str, int]:
    """Refuse an archive two readers could read differently; each member's data start.

    ``read(offset, n)`` reads the archive's bytes (``size`` of them). Raises
    :class:`FormatError` (two readings), :class:`LayoutError` (overlapping members) or
    :class:`TruncatedError` naming ``what`` and the member.
    """
    infos = zf.infolist()

    def inside(at: int, n: int) -> bytes:  # offsets from the file may lie anywhere (2**64 - 1)
        return read(at, min(n, size - at)) if 0 <= at < size and n > 0 else b""

    _check_directory(zf, infos, inside, size, what, path)
    starts: dict[str, int] = {}
    spans = []
    for info in infos:
        where = f"{what}: member {info.filename!r}"
        h = info.header_offset
        head = inside(h, _LOCAL.size)
        if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
            raise FormatError(f"{where} has no local header at {h}", path=path)
        n, e = _LOCAL.unpack(head)[9:]
        name_and_extra = inside(h + _LOCAL.size, n + e)
        encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
        if name_and_extra[:n] != info.orig_filename.encode(encoding, "surrogateescape"):
            raise FormatError(
                f"{where}: its local header does not match its central-directory entry (it "
                f"names {name_and_extra[:n][:80]!r}: two readings)",
                path=path,
            )
        problem = _local_problem(info, head, name_and_extra[n:])
        start = h + _LOCAL.size + n + e
        end = start + info.compress_size
        if problem is None and info.flag_bits & 0x8:
            problem = _descriptor_problem(info, inside, end)
        if problem is not None:
            raise FormatError(
                f"{where}: its local header does not match its central-directory entry "
                f"({problem}: two readings)",
                path=path,
            )
        if end > size:
            raise TruncatedError(f"{where} runs past the end of the archive", path=path)
        starts[info.filename] = start
        spans.append((h, end, info.filename))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise LayoutError(f"{what}: members {a!r} and {b!r} overlap", path=path)
    return starts


def _check_directory(
    zf: zipfile.ZipFile,
    infos: list[zipfile.ZipInfo],
    read: Read,
    size: int,
    what: str,
    path: str | None,
) -> None:
    """The end record agrees with the central directory, and no name is there twice."""
    end = _end_record(read, size)
    if end is None:
        raise FormatError(f"{what}: no end record (not a readable zip archive)", path=path)
    count, offset = end
    if offset != zf.start_dir:
        raise FormatError(
            f"{what}: its end record places the central directory at byte {offset}, it lies "
            f"at {zf.start_dir} ({zf.start_dir - offset} bytes before the archive: zip "
            "readers disagree on where its members are)",
            path=path,
        )
    if count != len(infos):
        raise FormatError(
            f"{what}: its end record counts {count} members, its central directory holds "
            f"{len(infos)} (two readings)",
            path=path,
        )
    seen: set[str] = set()
    for info in infos:
        for name in {info.filename, info.orig_filename}:
            if name in seen:
                raise FormatError(
                    f"{what}: member {name!r} is there twice (zip readers disagree on which "
                    "one is meant)",
                    path=path,
                )
        seen.update({info.filename, info.orig_filename})
