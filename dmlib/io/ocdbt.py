"""OCDBT, the key-value store under Orbax checkpoints, read and checked without tensorstore.

An OCDBT database is a directory holding ``manifest.ocdbt`` and data files (``d/<hex>``,
possibly under other folders: Orbax's top-level manifest points into the
``ocdbt.process_N/`` databases each process wrote). The manifest names the latest
B+tree root; B+tree nodes (interior and leaf) and large values live at (file, offset,
length) places in the data files. The format is documented by tensorstore (its
``kvstore/ocdbt`` driver page: manifest, version tree, B+tree node and data-file-table
encodings); this module follows that description.

Everything read is checked before it is used: magic numbers, versions, the CRC-32C at
the end of the manifest and of every node, every (file, offset, length) inside its file
(and every file path inside the database folder), decoded sizes under dmlib's own bound
(:data:`dmlib._limits.MAX_TREE_NODE` and the compression ratio of :mod:`dmlib._limits`; the
manifest's ``max_decoded_node_bytes`` may lower it, never raise it), node heights
decreasing by one down the tree, keys strictly increasing, the key counts the interior
nodes record. Every file read resolves, symlinks followed, inside the checkpoint's folder
and is a regular file (a symlink leading out, a FIFO or a device is refused naming it).
The B+tree is read whole when the store is opened (nodes are small); values stored out
of line are read when asked for.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dmlib import _limits
from dmlib.errors import FormatError, MissingDependencyError, TruncatedError, UnsupportedError
from dmlib.safepaths import confined_file, read_regular

__all__ = ["OcdbtStore", "crc32c", "open_store"]

MANIFEST = "manifest.ocdbt"
MANIFEST_MAGIC = 0x0CDB3A2A
BTREE_MAGIC = 0x0CDB20DE
_MAX_ENTRIES = 20_000_000  # entries visited over all paths: shared nodes stay bounded
# One full key (the prefixes of every level joined to a leaf's key): Orbax's keys are a
# leaf's name and a chunk key, well under 1 KiB.
_MAX_KEY = 1 << 16
_MAX_MANIFEST = 64 << 20

_EXTRA = "pip install 'dmlib[formats]'"


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``, by the ``crc32c`` package."""
    try:
        import crc32c as _crc
    except ImportError:
        raise MissingDependencyError(
            f"reading Orbax checkpoints needs the crc32c package: {_EXTRA}"
        ) from None
    return int(_crc.crc32c(data))


def zstd_decompress(data: bytes | memoryview, limit: int, what: str, path: str) -> bytes:
    """One zstd frame decoded, refused when it would exceed ``limit`` bytes."""
    try:
        import zstandard
    except ImportError:
        raise MissingDependencyError(
            f"reading Orbax checkpoints needs the zstandard package: {_EXTRA}", path=path
        ) from None
    try:
        params = zstandard.get_frame_parameters(bytes(data[:18]))
        size = params.content_size
        if size != zstandard.CONTENTSIZE_UNKNOWN and size > limit:
            raise FormatError(
                f"{what}: zstd frame claims {size} bytes (at most {limit} here; "
                f"{_limits.limit_hint()})",
                path=path,
            )
        dctx = _decompressor(zstandard)
        if size == zstandard.CONTENTSIZE_UNKNOWN:  # read at most limit + 1 bytes
            import io

            with dctx.stream_reader(io.BytesIO(bytes(data))) as reader:
                out = reader.read(limit + 1)
            if len(out) > limit:
                raise FormatError(
                    f"{what}: decodes to more than {limit} bytes ({_limits.limit_hint()})",
                    path=path,
                )
            return out
        return dctx.decompress(bytes(data), max_output_size=max(size, 1))
    except zstandard.ZstdError as err:
        raise FormatError(f"{what}: corrupt zstd data ({err})", path=path) from None


_LOCAL = threading.local()


def _decompressor(zstandard: Any) -> Any:
    """This thread's ``ZstdDecompressor`` (one per thread: making one per chunk cost as much
    as decoding a small chunk; one may not be used by two threads at once)."""
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


class _Cursor:
    """Reads the little-endian integers and varints of an OCDBT structure, bounds checked."""

    def __init__(self, data: bytes, what: str, path: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what
        self.path = path

    def fail(self, msg: str) -> FormatError:
        return FormatError(f"{self.what}: {msg} (at byte {self.pos})", path=self.path)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise TruncatedError(
                f"{self.what}: ends inside a field ({n} bytes wanted at {self.pos}, "
                f"{len(self.data)} in all)",
                path=self.path,
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32le(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64le(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def varint(self, limit: int = (1 << 64) - 1) -> int:
        value = shift = 0
        for _ in range(10):
            b = self.u8()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                if value > limit:
                    raise self.fail(f"value {value} exceeds {limit}")
                return value
            shift += 7
        raise self.fail("varint longer than 10 bytes")

    def varints(self, n: int, limit: int = (1 << 64) - 1) -> list[int]:
        return [self.varint(limit) for _ in range(n)]

    def done(self) -> None:
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} bytes left over after the last field")


@dataclass(frozen=True)
class Ref:
    """Bytes ``[offset, offset + length)`` of the data file ``path`` (relative to the root)."""

    path: str
    offset: int
    length: int


def _file_table(
    cur: _Cursor, transitive: str, spend: Callable[[int, str], None]
) -> list[tuple[str, str]]:
    """The data file table: per file, (full path, transitive path for its children); each
    path's bytes counted by ``spend`` before it is made."""
    n = cur.varint(1 << 20)
    prefix = cur.varints(max(n - 1, 0), 65535)
    suffix = cur.varints(n, 65535)
    base = cur.varints(n, 65535)
    out: list[tuple[str, str]] = []
    prev = b""
    for i in range(n):
        keep = prefix[i - 1] if i else 0
        if keep > len(prev):
            raise cur.fail(f"data file {i}: shared prefix {keep} longer than the previous path")
        spend(2 * len(transitive) + keep + suffix[i], f"data file {i}")
        path = prev[:keep] + cur.take(suffix[i])
        if base[i] > len(path):
            raise cur.fail(f"data file {i}: base path length {base[i]} beyond its path")
        try:
            text, btext = path.decode(), path[: base[i]].decode()
        except UnicodeDecodeError:
            raise cur.fail(f"data file {i}: path is not UTF-8") from None
        out.append((transitive + text, transitive + btext))
        prev = path
    return out


def _ref(
    cur: _Cursor, files: list[tuple[str, str]], fid: int, off: int, length: int
) -> tuple[Ref, str]:
    if fid >= len(files):
        raise cur.fail(f"data file id {fid} beyond the table of {len(files)}")
    return Ref(files[fid][0], off, length), files[fid][1]


@dataclass
class Manifest:
    """The decoded manifest: configuration and the latest version's root."""

    uuid: str
    max_inline_value_bytes: int
    max_decoded_node_bytes: int
    compression: str
    generation: int
    root: Ref | None
    root_height: int
    root_transitive: str
    num_keys: int
    num_versions: int
    version_nodes: int


class OcdbtStore:
    """An OCDBT database folder: its keys, and each key's value on request.

    Attributes
    ----------
    root
        The folder holding ``manifest.ocdbt``.
    manifest
        The decoded :class:`Manifest`.
    keys
        key (str) -> inline ``bytes`` or a :class:`Ref` into a data file, in key order.
    nodes
        Number of B+tree nodes read (each CRC-checked).
    height
        Height of the B+tree (0: the root is a leaf).
    """

    def __init__(self, root: str, top: str | None = None) -> None:
        self.root = os.path.abspath(root)
        # every file read must resolve inside ``top`` (the checkpoint opened), symlinks followed
        self.top = os.path.abspath(top if top is not None else root)
        self._real_top = os.path.realpath(self.top)
        self._sizes: dict[str, int] = {}
        self._real: dict[str, str] = {}
        self.nodes = 0
        self.keys: dict[str, bytes | Ref] = {}
        # entries visited, and bytes of keys and paths made, over the whole database
        self._visited = 0
        self._max_entries = min(_MAX_ENTRIES, _limits.max_entries())
        self._bytes = 0
        self._max_bytes = _limits.max_name_chars_total()
        self.manifest = self._read_manifest()
        self.height = self.manifest.root_height
        self._cache: dict[tuple[Ref, str], tuple[int, list[tuple[Any, ...]]]] = {}
        if self.manifest.root is not None:
            self._walk(self.manifest.root, self.height, b"", self.manifest.root_transitive)
        if self.manifest.num_keys != len(self.keys):
            raise FormatError(
                f"the manifest records {self.manifest.num_keys} keys, the B+tree holds {len(self.keys)}",
                path=self.root,
            )

    def _spend(self, n: int, what: str) -> None:
        """Count ``n`` bytes of keys or paths about to be made, refused past the bound."""
        self._bytes += n
        if self._bytes > self._max_bytes:
            raise FormatError(
                f"{what}: keys and data file paths of more than {_limits.human(self._max_bytes)}"
                " together, the most one database's may take on this machine (shared key "
                "prefixes repeated?)",
                path=self.root,
            )

    # files ------------------------------------------------------------------------------
    def _file(self, rel: str) -> str:
        """Absolute path of data file ``rel``, which must stay inside the database folder."""
        parts = rel.split("/")
        bad = "\\" in rel or "\x00" in rel
        if rel.startswith("/") or bad or any(p in ("", ".", "..") for p in parts):
            raise FormatError(
                f"data file path {rel!r} is not a plain relative path inside the database",
                path=self.root,
            )
        return os.path.join(self.root, *parts)

    def _size(self, rel: str) -> int:
        if rel not in self._sizes:
            found = confined_file(
                self._real_top, self._file(rel), what=f"data file {rel}", where=self.top,
                error=FormatError,
            )  # fmt: skip
            if found is None:
                raise TruncatedError(f"data file {rel} is missing", path=self.root)
            self._real[rel], self._sizes[rel] = found
        return self._sizes[rel]

    def check(self, ref: Ref, what: str) -> None:
        """Raise unless ``ref`` lies inside its data file."""
        size = self._size(ref.path)
        if ref.offset + ref.length > size:
            raise TruncatedError(
                f"{what} at {ref.path} [{ref.offset}, {ref.offset + ref.length}) lies beyond "
                f"the file's {size} bytes",
                path=self.root,
            )

    def read_ref(self, ref: Ref, what: str) -> bytes:
        """The bytes at ``ref`` (checked against the file's size first)."""
        self.check(ref, what)
        data = read_regular(
            self._real[ref.path], ref.offset, ref.length,
            what=f"data file {ref.path}", where=self.root, error=FormatError,
        )  # fmt: skip
        if len(data) != ref.length:
            raise TruncatedError(f"{what}: short read from {ref.path}", path=self.root)
        return data

    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None when the key is absent."""
        v = self.keys.get(key)
        if v is None or isinstance(v, bytes):
            return v
        return self.read_ref(v, f"value of {key!r}")

    # framing ----------------------------------------------------------------------------
    def _unframe(self, data: bytes, magic: int, what: str, limit: int) -> tuple[bytes, str]:
        """Check header, length and CRC of an encoded manifest or node; its decoded body
        (at most ``limit`` bytes, and no more than :mod:`dmlib._limits` lets its stored size
        inflate to)."""
        if len(data) < 4 + 8 + 1 + 1 + 4:
            raise TruncatedError(
                f"{what}: {len(data)} bytes, shorter than its header", path=self.root
            )
        if int.from_bytes(data[:4], "big") != magic:
            raise FormatError(f"{what}: magic {data[:4].hex()} is not {magic:08x}", path=self.root)
        length = int.from_bytes(data[4:12], "little")
        if length != len(data):
            raise TruncatedError(
                f"{what}: header says {length} bytes, {len(data)} are there", path=self.root
            )
        stored = int.from_bytes(data[-4:], "little")
        if crc32c(data[:-4]) != stored:
            raise FormatError(f"{what}: CRC-32C mismatch (damaged)", path=self.root)
        cur = _Cursor(data[:-4], what, self.root)
        cur.pos = 12
        version = cur.varint()
        if version != 0:
            raise UnsupportedError(f"{what}: format version {version} (0 is known)", path=self.root)
        comp = cur.varint()
        body = data[cur.pos : -4]
        if comp == 0:
            return body, "none"
        if comp == 1:
            limit = min(limit, _limits.allowed_output(len(body)))
            return zstd_decompress(body, limit, what, self.root), "zstd"
        raise UnsupportedError(f"{what}: compression {comp} (0 none, 1 zstd)", path=self.root)

    # manifest ---------------------------------------------------------------------------
    def _read_manifest(self) -> Manifest:
        mpath = os.path.join(self.root, MANIFEST)
        rel = os.path.relpath(mpath, self.top)
        found = confined_file(self._real_top, mpath, what=rel, where=self.top, error=FormatError)
        if found is None:
            raise FormatError(f"no {MANIFEST} (not an OCDBT database)", path=self.root)
        # bounded on the file opened (fstat), not on confined_file's earlier look
        data = read_regular(
            found[0], what=MANIFEST, where=self.root, error=FormatError, limit=_MAX_MANIFEST,
            kind="a manifest",
        )  # fmt: skip
        body, comp = self._unframe(data, MANIFEST_MAGIC, MANIFEST, _MAX_MANIFEST)
        cur = _Cursor(body, MANIFEST, self.root)
        uuid = cur.take(16).hex()
        kind = cur.varint()
        if kind != 0:
            raise UnsupportedError(
                f"{MANIFEST}: manifest kind {kind} (numbered manifests are not read; 0 single)",
                path=self.root,
            )
        inline_max = cur.varint()
        node_max = cur.varint(1 << 32)
        arity_log2 = cur.u8()
        if not 1 <= arity_log2 <= 16:
            raise cur.fail(f"version tree arity log2 {arity_log2} outside 1..16")
        method = cur.varint()
        if method == 1:
            cur.take(4)  # zstd level, for writers
        elif method != 0:
            raise UnsupportedError(f"{MANIFEST}: compression method {method}", path=self.root)
        files = _file_table(cur, "", self._spend)
        versions = self._versions(cur, files, arity_log2)
        n_nodes = cur.varint(1 << 20)
        cur.varints(n_nodes)  # generation numbers
        for _ in range(3 * n_nodes):  # file ids, offsets, lengths
            cur.varint()
        cur.varints(n_nodes)  # num_generations
        for _ in range(n_nodes):
            cur.u64le()  # commit times
        cur.take(n_nodes)  # entry heights
        cur.done()
        del comp
        if not versions:
            return Manifest(
                uuid,
                inline_max,
                node_max,
                "zstd" if method else "none",
                0,
                None,
                0,
                "",
                0,
                0,
                n_nodes,
            )
        gen, height, ref, trans, nkeys = versions[-1]
        return Manifest(
            uuid, inline_max, node_max, "zstd" if method else "none", gen,
            ref if ref.length else None, height, trans, nkeys, len(versions), n_nodes,
        )  # fmt: skip

    def _versions(
        self, cur: _Cursor, files: list[tuple[str, str]], arity_log2: int
    ) -> list[tuple[int, int, Ref, str, int]]:
        n = cur.varint(1 << arity_log2)
        gens = cur.varints(n)
        heights = list(cur.take(n))
        fids = cur.varints(n)
        offs = cur.varints(n)
        lens = cur.varints(n)
        nkeys = cur.varints(n)
        cur.varints(n)  # num_tree_bytes
        cur.varints(n)  # num_indirect_value_bytes
        for _ in range(n):
            cur.u64le()  # commit time
        if any(g == 0 for g in gens) or any(a >= b for a, b in zip(gens, gens[1:])):
            raise cur.fail(f"generation numbers {gens} are not positive and increasing")
        out = []
        for i in range(n):
            ref, trans = _ref(cur, files, fids[i], offs[i], lens[i])
            out.append((gens[i], heights[i], ref, trans, nkeys[i]))
        return out

    # B+tree -----------------------------------------------------------------------------
    def _node(
        self, ref: Ref, transitive: str, what: str
    ) -> tuple[int, _Cursor, list[tuple[str, str]], int]:
        data = self.read_ref(ref, what)
        self.nodes += 1
        # dmlib's own bound: a manifest may lower it (max_decoded_node_bytes), never raise it
        limit = min(self.manifest.max_decoded_node_bytes, _limits.MAX_TREE_NODE)
        body, _ = self._unframe(data, BTREE_MAGIC, what, limit)
        cur = _Cursor(body, what, self.root)
        height = cur.u8()
        files = _file_table(cur, transitive, self._spend)
        n = cur.varint(self._max_entries)
        return height, cur, files, n

    def _keys(self, cur: _Cursor, n: int, interior: bool) -> tuple[list[bytes], list[int]]:
        prefix = cur.varints(max(n - 1, 0), 1 << 16)
        suffix = cur.varints(n, 1 << 16)
        common = cur.varints(n, 1 << 16) if interior else []
        keys: list[bytes] = []
        prev = b""
        for i in range(n):
            keep = prefix[i - 1] if i else 0
            if keep > len(prev):
                raise cur.fail(f"entry {i}: shared key prefix {keep} longer than the previous key")
            self._spend(keep + suffix[i], f"{cur.what}: entry {i}")
            key = prev[:keep] + cur.take(suffix[i])
            if keys and key <= keys[-1]:
                raise cur.fail(f"entry {i}: keys are not strictly increasing")
            keys.append(key)
            prev = key
        for i, c in enumerate(common):
            if c > len(keys[i]):
                raise cur.fail(f"entry {i}: subtree prefix {c} longer than its key")
        return keys, common

    def _parsed(self, ref: Ref, transitive: str) -> tuple[int, list[tuple[Any, ...]]]:
        """A node read, checked and decoded once: (height, entries). Interior entries are
        (key, subtree prefix length, child Ref, child transitive path, key count); leaf
        entries (relative key, inline bytes or value Ref)."""
        ck = (ref, transitive)
        if ck in self._cache:
            return self._cache[ck]
        what = f"B+tree node {ref.path}@{ref.offset}"
        height, cur, files, n = self._node(ref, transitive, what)
        if height == 0:
            out = (0, self._leaf(cur, files, n))
        else:
            keys, common = self._keys(cur, n, interior=True)
            fids, offs, lens, nkeys = (cur.varints(n) for _ in range(4))
            cur.varints(n)  # num_tree_bytes
            cur.varints(n)  # num_indirect_value_bytes
            cur.done()
            entries: list[tuple[Any, ...]] = []
            for i in range(n):
                child, trans = _ref(cur, files, fids[i], offs[i], lens[i])
                self.check(child, f"{what}: child {i}")
                entries.append((keys[i], common[i], child, trans, nkeys[i]))
            out = (height, entries)
        self._cache[ck] = out
        return out

    def _walk(self, ref: Ref, height: int, prefix: bytes, transitive: str) -> int:
        """Read the subtree at ``ref`` into ``self.keys``; the number of keys it holds.

        A node may be reached by more than one path (the format allows it): it is read
        once, and the entries visited over all paths are bounded."""
        got, entries = self._parsed(ref, transitive)
        self._visited += len(entries) + 1
        if self._visited > self._max_entries:
            raise FormatError(
                f"B+tree visits more than {self._max_entries} entries (nodes shared too often?)",
                path=self.root,
            )
        where = f"B+tree node {ref.path}@{ref.offset}"
        if got != height:
            raise FormatError(f"{where}: height {got}, its parent expects {height}", path=self.root)
        if height == 0:
            for key, value in entries:
                self._key_fits(prefix, key, where)
                full = prefix + key
                try:
                    name = full.decode()
                except UnicodeDecodeError:
                    raise FormatError(
                        f"{where}: key {full!r} is not UTF-8", path=self.root
                    ) from None
                if name in self.keys:
                    raise FormatError(
                        f"{where}: key {name!r} appears twice in the tree", path=self.root
                    )
                self.keys[name] = value
            return len(entries)
        total = 0
        for i, (key, common, child, trans, nkeys) in enumerate(entries):
            self._key_fits(prefix, key[:common], where)
            got_keys = self._walk(child, height - 1, prefix + key[:common], trans)
            if got_keys != nkeys:
                raise FormatError(
                    f"{where}: child {i} holds {got_keys} keys, the node records {nkeys}",
                    path=self.root,
                )
            total += got_keys
        return total

    def _key_fits(self, prefix: bytes, key: bytes, where: str) -> None:
        """Refuse a full key (``prefix + key``) longer than any real one, before it is made."""
        size = len(prefix) + len(key)
        if size > _MAX_KEY:
            raise FormatError(
                f"{where}: a key of {size} bytes (its prefixes joined), more than {_MAX_KEY}",
                path=self.root,
            )
        self._spend(2 * size, where)  # the key's bytes, and its text

    def _leaf(self, cur: _Cursor, files: list[tuple[str, str]], n: int) -> list[tuple[Any, ...]]:
        keys, _ = self._keys(cur, n, interior=False)
        lengths = cur.varints(n)
        kinds = cur.varints(n, 1)
        indirect = [i for i in range(n) if kinds[i] == 1]
        fids = cur.varints(len(indirect))
        offs = cur.varints(len(indirect))
        values: dict[int, bytes | Ref] = {}
        for k, i in enumerate(indirect):
            ref, _ = _ref(cur, files, fids[k], offs[k], lengths[i])
            self.check(ref, f"value of key {keys[i]!r}")
            values[i] = ref
        for i in range(n):
            if kinds[i] == 0:
                values[i] = cur.take(lengths[i])
        cur.done()
        return [(keys[i], values[i]) for i in range(n)]

    def describe(self) -> dict[str, Any]:
        """Layout facts for ``inspect``: format, compression, tree height, nodes, files."""
        m = self.manifest
        return {
            "ocdbt_version": 0,
            "ocdbt_compression": m.compression,
            "btree_height": self.height,
            "btree_nodes": self.nodes,
            "keys": len(self.keys),
            "generation": m.generation,
            "data_files": len(self._sizes),
            "max_inline_value_bytes": m.max_inline_value_bytes,
        }


def open_store(
    root: str | os.PathLike[str], top: str | os.PathLike[str] | None = None
) -> OcdbtStore:
    """Open and check the OCDBT database in folder ``root``; every file it reads must
    resolve inside ``top`` (default ``root``), symlinks followed."""
    return OcdbtStore(os.fspath(root), None if top is None else os.fspath(top))
