"""Identity hashes of tensor bytes: a fast default, SHA-256 on request, each named in its text.

Every hash dmlib's comparisons return is a string ``"<name>:<hex>"`` so that the
algorithm is always recorded beside the digest, and two digests of different schemes
never compare equal.

``blake3-64MiB`` (the default)
    BLAKE3 (cryptographic, so a collision cannot make two different tensors look
    identical; several GB/s per core with SIMD) over fixed pieces of :data:`PIECE` =
    64 MiB, defined so that the digest of a byte string ``x`` of length ``n`` can be
    combined exactly from independently hashed pieces:

    - ``n <= PIECE``: ``BLAKE3(x)``, the plain digest (what ``b3sum`` prints);
    - otherwise, with ``d_i = BLAKE3(x[i*PIECE : (i+1)*PIECE])`` for ``i = 0..k-1``,
      ``k = ceil(n / PIECE)``: ``BLAKE3(b"dmlib-pieces-v1" || u64le(PIECE) || u64le(n)
      || d_0 || d_1 || ... || d_{k-1})`` (each ``d_i`` the 32-byte digest).

    A distributed engine hashes pieces ``[i*PIECE, (i+1)*PIECE)`` wherever they are read
    and calls :func:`combine` on the ordered piece digests: the result equals this
    module's streaming hash bit for bit.
``sha256``
    Plain SHA-256 of the bytes (what ``sha256sum`` of the extracted bytes prints), for
    provenance against published sums. SHA-256 is sequential: it is not combinable from
    pieces, so a distributed engine computes it in one task per tensor.

``cksum4-v1``
    An integer checksum a GPU computes with torch ops (:func:`checksum_torch`), bit-exact
    with the numpy host reference (:func:`checksum_host`); not cryptographic.

BLAKE3 rather than xxh3-128 (faster still, but not cryptographic): ``dmlib.matrix``
treats equal digests as equal bytes, so the hash must not collide or be forgeable by
construction. (A capture's host digests are XXH3-128 by default: there the digests are
written by the process that ran the model and read as its statement, so a crafted
collision buys nothing a forged manifest does not; see docs/formats.md.) Measured on this project's machine: BLAKE3 2.2 GB/s on one core against
SHA-256's 0.84 GB/s; it runs on worker threads beside the comparison.

The bare SHA-256 helpers at the end (:func:`hash_bytes`, :func:`hash_file`...) serve the
formats that store plain hex SHA-256: version-1 capture manifests, file manifests, ``inspect``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlib.errors import DmlibError

if TYPE_CHECKING:
    import hashlib


def _sha256(data: bytes | memoryview = b"") -> hashlib._Hash:
    """A SHA-256 hasher (hashlib is imported when one is first needed: start-up time)."""
    import hashlib

    return hashlib.sha256(data)


#: Piece size of the combinable scheme (bytes).
PIECE = 64 << 20
BLAKE3 = "blake3-64MiB"
SHA256 = "sha256"
#: Scheme names accepted by ``hash=`` (the first is the default).
ALGORITHMS = (BLAKE3, SHA256)
DEFAULT = BLAKE3
_ALIASES = {"blake3": BLAKE3, BLAKE3.lower(): BLAKE3, "sha256": SHA256, "sha-256": SHA256}
_DOMAIN = b"dmlib-pieces-v1"
CHUNK = 1 << 24  # 16 MiB: bounded memory for whole-file hashing


def algorithm(name: str | None) -> str:
    """The canonical scheme name for ``name`` (None: the default); DmlibError if unknown."""
    if name is None:
        return DEFAULT
    canon = _ALIASES.get(str(name).lower())
    if canon is None:
        raise DmlibError(f"unknown hash {name!r}: use one of {', '.join(ALGORITHMS)} (or 'blake3')")
    return canon


def _blake3() -> Any:
    try:
        from blake3 import blake3
    except ImportError:  # pragma: no cover - a core dependency
        from dmlib.errors import MissingDependencyError

        raise MissingDependencyError(
            "the default hash needs the blake3 package: pip install blake3 (or pass hash='sha256')"
        ) from None
    return blake3


def xxh3_128() -> Any:
    """The ``xxhash`` module (XXH3-128, the default leaf hash of a capture's host digests)."""
    try:
        import xxhash
    except ImportError:  # pragma: no cover - a core dependency
        from dmlib.errors import MissingDependencyError

        raise MissingDependencyError(
            "a capture's default hash needs the xxhash package: pip install xxhash (or "
            "capture with hash='blake3')"
        ) from None
    return xxhash


def _as_bytes(data: bytes | memoryview | np.ndarray) -> memoryview:
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    return memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)


def combine(piece_digests: Sequence[bytes], nbytes: int) -> str:
    """The ``blake3-64MiB`` digest of ``nbytes`` bytes from its pieces' raw BLAKE3 digests, in order."""
    k = -(-nbytes // PIECE)
    if len(piece_digests) != max(k, 1):
        raise DmlibError(
            f"{nbytes} bytes make {max(k, 1)} pieces of {PIECE}, got {len(piece_digests)} digests"
        )
    if nbytes <= PIECE:
        return f"{BLAKE3}:{piece_digests[0].hex()}"
    h = _blake3()(_DOMAIN + PIECE.to_bytes(8, "little") + nbytes.to_bytes(8, "little"))
    for d in piece_digests:
        h.update(d)
    return f"{BLAKE3}:{h.hexdigest()}"


def piece_digest(data: bytes | memoryview | np.ndarray) -> bytes:
    """Raw 32-byte BLAKE3 of one piece (at most :data:`PIECE` bytes)."""
    return _blake3()(_as_bytes(data)).digest()


class Hasher:
    """Streaming hash in one scheme: ``update`` with consecutive bytes, then ``hexdigest``.

    ``threads`` > 1 lets BLAKE3 hash each update on that many threads (the digest does
    not depend on it); SHA-256 is sequential and ignores it.
    """

    def __init__(self, name: str | None = None, threads: int = 1) -> None:
        self.name = algorithm(name)
        self.nbytes = 0
        if self.name == SHA256:
            self._h: Any = _sha256()
        else:
            b3 = _blake3()
            self._b3 = (lambda: b3(max_threads=threads)) if threads > 1 else b3
            self._h = self._b3()
            self._fill = 0  # bytes in the current piece
            self._pieces: list[bytes] = []

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        """Feed the next bytes (an ndarray as its raw C-order bytes)."""
        mv = _as_bytes(data)
        self.nbytes += mv.nbytes
        if self.name == SHA256:
            self._h.update(mv)
            return
        while mv.nbytes:
            take = min(mv.nbytes, PIECE - self._fill)
            self._h.update(mv[:take])
            self._fill += take
            mv = mv[take:]
            if self._fill == PIECE:
                self._pieces.append(self._h.digest())
                self._h, self._fill = self._b3(), 0

    def copy(self) -> Hasher:
        """An independent hasher in this one's state (the bytes fed so far, and the scheme)."""
        other = Hasher.__new__(Hasher)
        other.__dict__.update(self.__dict__)
        other._h = self._h.copy()
        if self.name != SHA256:
            other._pieces = list(self._pieces)
        return other

    def hexdigest(self) -> str:
        """``"<name>:<hex>"`` of everything fed so far."""
        if self.name == SHA256:
            return f"{SHA256}:{self._h.hexdigest()}"
        pieces = list(self._pieces)
        if self._fill or not pieces:
            pieces.append(self._h.digest())
        return combine(pieces, self.nbytes)


def digest_bytes(data: bytes | memoryview | np.ndarray, name: str | None = None) -> str:
    """``"<name>:<hex>"`` of exactly these bytes (an ndarray as its raw C-order bytes)."""
    h = Hasher(name)
    h.update(data)
    return h.hexdigest()


def digest_file(
    path: str | os.PathLike[str], name: str | None = None, start: int = 0, end: int | None = None
) -> str:
    """``"<name>:<hex>"`` of the byte range ``[start, end)`` of a file, read in bounded chunks."""
    h = Hasher(name)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        remaining = None if end is None else end - start
        while remaining is None or remaining > 0:
            n = CHUNK if remaining is None else min(CHUNK, remaining)
            got = f.readinto(view[:n])
            if not got:
                break
            h.update(view[:got])
            if remaining is not None:
                remaining -= got
    return h.hexdigest()


# -- bare SHA-256 hex: the capture format, file manifests and ``dmlib inspect`` -------------


def new_hasher() -> hashlib._Hash:
    """A fresh hashlib SHA-256 hasher."""
    return _sha256()


def hash_bytes(data: bytes | memoryview | np.ndarray) -> str:
    """Bare SHA-256 hex of exactly these bytes (an ndarray as its raw C-order bytes)."""
    return _sha256(_as_bytes(data)).hexdigest()


def hash_chunks(chunks: Iterable[bytes | memoryview | np.ndarray]) -> str:
    """Bare SHA-256 hex of the chunks' bytes, concatenated in order."""
    h = _sha256()
    for c in chunks:
        h.update(_as_bytes(c))
    return h.hexdigest()


def hash_file(path: str | os.PathLike[str], start: int = 0, end: int | None = None) -> str:
    """Bare SHA-256 hex of the byte range ``[start, end)`` of a file (whole file by default)."""
    return digest_file(path, SHA256, start, end).split(":", 1)[1]


# -- a checksum that a GPU computes with integer torch ops, bit-exact with the host ------------

#: Name of the checksum scheme (recorded as ``"cksum4-v1:<hex>"``).
CHECKSUM = "cksum4-v1"
_P = (1 << 31) - 1  # a prime: every product below stays under 2**62, exact in int64
_LANES = (0x1F3D5B79, 0x2C4E6A80, 0x3D5B7991, 0x4E6A8CA2)  # one offset per lane
_CK_CHUNK = 1 << 22  # 16-bit halves per step: bounds the int64 temporaries (32 MiB each)


def _checksum_words(halves: np.ndarray, start: int) -> list[int]:
    """Lane sums of ``h_k * W_j(start + k) mod p``, W_j(k) = ((k mod p + c_j)^2 mod p) + 1."""
    n = int(halves.shape[0])
    k = np.arange(start, start + n, dtype=np.int64) % _P
    out = []
    for c in _LANES:
        w = (k + c) % _P
        w = (w * w) % _P + 1
        # h < 2**16 and w <= p: each term < 2**47; reduce before summing n < 2**31 terms
        out.append(int(((halves * w) % _P).sum()) % _P)
    return out


def _finish(lanes: list[int], nbytes: int) -> str:
    words = [nbytes, *lanes]
    return f"{CHECKSUM}:" + "".join(f"{w:016x}" for w in words)


def checksum_host(data: bytes | memoryview | np.ndarray) -> str:
    """``"cksum4-v1:<hex>"`` of these bytes, computed with numpy (the exact host reference).

    The bytes are padded with zeros to an even length and read as little-endian 16-bit
    halves ``h_k``; four lanes ``S_j = sum_k h_k * W_j(k) mod p`` (p = 2**31 - 1, W_j a
    quadratic in the position k) and the length make the checksum. Integer sums are
    exact whatever their order, so a device computes the same value with torch ops
    (:func:`checksum_torch`). Not cryptographic: it tells equal captures from unequal
    ones (a random change escapes with probability about p**-4), not adversaries.
    """
    mv = _as_bytes(data)
    nbytes = mv.nbytes
    raw = np.frombuffer(mv, np.uint8)
    lanes = [0, 0, 0, 0]
    step = 2 * _CK_CHUNK
    for off in range(0, nbytes, step):
        piece = raw[off : off + step]
        if piece.size % 2:
            piece = np.concatenate([piece, np.zeros(1, np.uint8)])
        halves = piece.view("<u2").astype(np.int64)
        for j, s in enumerate(_checksum_words(halves, off // 2)):
            lanes[j] = (lanes[j] + s) % _P
    return _finish(lanes, nbytes)


def checksum_torch(tensor: Any) -> str:
    """:func:`checksum_host` of a torch tensor's bytes, computed where the tensor lives.

    On a GPU only the four lane sums (a few bytes) come back to the host; the value is
    bit-identical to the host reference on the same bytes, any device, any dtype.
    """
    import torch

    t = tensor.detach().contiguous().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    nbytes = int(raw.numel())
    lanes = [0, 0, 0, 0]
    step = 2 * _CK_CHUNK
    for off in range(0, nbytes, step):
        piece = raw[off : off + step].to(torch.int64)
        if piece.numel() % 2:
            piece = torch.cat([piece, piece.new_zeros(1)])
        halves = piece[0::2] + piece[1::2] * 256  # little-endian 16-bit halves
        for j, s in enumerate(_checksum_words_torch(halves, off // 2)):
            lanes[j] = (lanes[j] + s) % _P
    return _finish(lanes, nbytes)


def _checksum_words_torch(halves: Any, start: int) -> list[int]:
    import torch

    n = int(halves.shape[0])
    k = torch.arange(start, start + n, dtype=torch.int64, device=halves.device) % _P
    sums = []
    for c in _LANES:
        w = (k + c) % _P
        w = (w * w) % _P + 1
        sums.append(((halves * w) % _P).sum())
    # one transfer of four integers per piece
    return [int(v) % _P for v in torch.stack(sums).cpu().tolist()]


# -- cksum4-v1 of any run of whole rows, from three sums per row taken on the device ---------
#
# With h_k the halves of one row (k = 0..H-1) placed at half offset o of a hashed string,
# its share of lane j is sum_k h_k * W_j(o + k) = ((o + c_j)^2 + 1) * M0 + 2 (o + c_j) * M1
# + M2 (mod p), where M0 = sum h_k, M1 = sum k h_k and M2 = sum k^2 h_k (mod p): W_j is a
# quadratic in the position. So three sums per row, taken once where the tensor lives,
# give the exact checksum of the whole tensor, of any request's rows in any order and of
# each of their blocks, on the host, with a few bytes per row crossing over.


def row_moments_torch(rows: Any) -> np.ndarray:
    """``(n, 3)`` int64 ``(M0, M1, M2) mod p`` of each row of a 2-d tensor, on its device.

    Each row's byte length must be even (its halves stay inside it); ValueError otherwise.
    """
    import sys

    import torch

    if sys.byteorder != "little":  # pragma: no cover - the halves are read little-endian
        raise ValueError("row moments read little-endian halves")
    n = int(rows.shape[0])
    raw = rows.detach().contiguous()
    raw = raw.view(torch.uint8) if raw.dtype != torch.bool else raw.to(torch.uint8)
    raw = raw.reshape(n, -1)
    if raw.shape[1] % 2:
        raise ValueError(f"rows of {raw.shape[1]} bytes: odd, halves would cross rows")
    h_count = raw.shape[1] // 2
    out = torch.zeros((n, 3), dtype=torch.int64, device=raw.device)
    if n and h_count:
        k = torch.arange(h_count, dtype=torch.int64, device=raw.device)
        k2 = (k * k) % _P
        step = max(1, _CK_CHUNK // h_count)  # rows per step: bounds the int64 temporaries
        for s in range(0, n, step):
            halves = raw[s : s + step].view(torch.int16).to(torch.int64) & 0xFFFF
            out[s : s + step, 0] = halves.sum(1) % _P
            out[s : s + step, 1] = ((halves * k) % _P).sum(1) % _P
            out[s : s + step, 2] = ((halves * k2) % _P).sum(1) % _P
    return out.cpu().numpy()


def checksum_of_rows(moments: np.ndarray, row_bytes: int) -> str:
    """``cksum4-v1`` of the rows whose :func:`row_moments_torch` are given, concatenated in order."""
    m = np.asarray(moments, dtype=np.int64).reshape(-1, 3)
    half = row_bytes // 2
    offsets = (np.arange(m.shape[0], dtype=np.int64) * half) % _P
    lanes = []
    for c in _LANES:
        a = (offsets + c) % _P
        t = (((a * a) % _P + 1) * m[:, 0]) % _P
        t = (t + ((2 * a) % _P) * m[:, 1]) % _P
        t = (t + m[:, 2]) % _P
        lanes.append(int(t.sum()) % _P)
    return _finish(lanes, int(m.shape[0]) * row_bytes)
