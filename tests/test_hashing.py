"""dmlib.hashing: the named identity hashes, against blake3/hashlib and the documented piece rule."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from blake3 import blake3

from dmlib import hashing
from dmlib.errors import DmlibError


def pieces_by_hand(data: bytes, piece: int) -> str:
    """The documented rule, written out from the module docstring with the blake3 package."""
    if len(data) <= piece:
        return "blake3-64MiB:" + blake3(data).hexdigest()
    head = b"dmlib-pieces-v1" + piece.to_bytes(8, "little") + len(data).to_bytes(8, "little")
    digests = b"".join(blake3(data[i : i + piece]).digest() for i in range(0, len(data), piece))
    return "blake3-64MiB:" + blake3(head + digests).hexdigest()


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 4096, 5000])
def test_piece_rule_with_small_pieces(monkeypatch, n):
    # the rule does not depend on the piece size: check it (and every boundary) on 1 KiB pieces
    monkeypatch.setattr(hashing, "PIECE", 1024)
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    expect = pieces_by_hand(data, 1024)
    assert hashing.digest_bytes(data) == expect
    # streamed in uneven chunks that straddle piece boundaries: the same digest
    h = hashing.Hasher("blake3")
    for i in range(0, n, 333):
        h.update(data[i : i + 333])
    assert h.hexdigest() == expect
    # hashed piece by piece elsewhere (as a distributed engine does), then combined
    parts = [hashing.piece_digest(data[i : i + 1024]) for i in range(0, max(n, 1), 1024)]
    assert hashing.combine(parts, n) == expect


def test_threads_do_not_change_the_digest(monkeypatch):
    # the comparison loop hashes with BLAKE3 on several threads: the digest is the rule's
    monkeypatch.setattr(hashing, "PIECE", 1 << 16)
    data = np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    h = hashing.Hasher("blake3", threads=3)
    for i in range(0, len(data), 70_001):
        h.update(data[i : i + 70_001])
    assert h.hexdigest() == pieces_by_hand(data, 1 << 16)


def test_real_piece_size_across_one_boundary():
    data = (np.arange((64 << 20) + 100, dtype=np.uint64) % 251).astype(np.uint8)
    raw = data.tobytes()
    assert hashing.PIECE == 64 << 20
    assert hashing.digest_bytes(data) == pieces_by_hand(raw, 64 << 20)
    # one piece: plain BLAKE3, what b3sum prints
    assert (
        hashing.digest_bytes(data[: 64 << 20])
        == "blake3-64MiB:" + blake3(raw[: 64 << 20]).hexdigest()
    )


def test_sha256_is_plain_and_named(tmp_path):
    data = b"dmlib" * 1000
    assert hashing.digest_bytes(data, "sha256") == "sha256:" + hashlib.sha256(data).hexdigest()
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    assert hashing.digest_file(p, "sha256") == "sha256:" + hashlib.sha256(data).hexdigest()
    assert (
        hashing.digest_file(p, "sha256", 5, 50)
        == "sha256:" + hashlib.sha256(data[5:50]).hexdigest()
    )
    assert hashing.digest_file(p) == "blake3-64MiB:" + blake3(data).hexdigest()
    assert hashing.hash_file(p) == hashlib.sha256(data).hexdigest()  # bare, for manifests


def test_names_and_errors():
    assert hashing.algorithm(None) == "blake3-64MiB"
    assert hashing.algorithm("BLAKE3") == hashing.algorithm("blake3-64mib") == "blake3-64MiB"
    with pytest.raises(DmlibError, match="unknown hash 'md5'"):
        hashing.algorithm("md5")
    with pytest.raises(DmlibError, match="pieces"):
        hashing.combine([b"\0" * 32], (64 << 20) + 1)
    # different schemes never compare equal, even on the same bytes
    assert hashing.digest_bytes(b"") != hashing.digest_bytes(b"", "sha256")


# -- the device checksum: torch ops against the numpy host reference ---------------------------


def checksum_by_hand(data: bytes) -> str:
    """The documented rule in plain Python integers (no numpy, no torch)."""
    p = (1 << 31) - 1
    lanes = (0x1F3D5B79, 0x2C4E6A80, 0x3D5B7991, 0x4E6A8CA2)
    padded = data + b"\0" * (len(data) % 2)
    halves = [int.from_bytes(padded[i : i + 2], "little") for i in range(0, len(padded), 2)]
    out = [len(data)]
    for c in lanes:
        out.append(sum(h * ((((k % p) + c) % p) ** 2 % p + 1) for k, h in enumerate(halves)) % p)
    return "cksum4-v1:" + "".join(f"{w:016x}" for w in out)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 1001])
def test_checksum_host_matches_the_rule(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert hashing.checksum_host(data) == checksum_by_hand(data)


def test_checksum_across_host_chunks(monkeypatch):
    monkeypatch.setattr(hashing, "_CK_CHUNK", 3)  # pieces of 6 bytes: positions carry over
    data = bytes(range(256)) * 3 + b"\x01"
    assert hashing.checksum_host(data) == checksum_by_hand(data)


def test_checksum_torch_equals_host_on_cpu_tensors(monkeypatch):
    # no GPU here: the torch path runs on CPU tensors, the same ops a GPU runs
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    cases = [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(4, 3, generator=g).to(torch.float16).t(),  # not contiguous
        torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),  # odd byte count
        torch.tensor([True, False, True]),
        torch.zeros(0),
    ]
    for t in cases:
        host_bytes = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert (
            hashing.checksum_torch(t)
            == hashing.checksum_host(host_bytes)
            == checksum_by_hand(host_bytes)
        )
    monkeypatch.setattr(hashing, "_CK_CHUNK", 5)
    t = torch.randn(33, generator=g)
    raw = t.view(torch.uint8).numpy().tobytes()
    assert hashing.checksum_torch(t) == checksum_by_hand(raw)


def test_checksum_sees_every_single_bit_flip():
    base = bytearray(np.random.default_rng(9).integers(0, 256, 40, dtype=np.uint8).tobytes())
    ref = hashing.checksum_host(bytes(base))
    seen = {ref}
    for i in range(len(base)):
        for bit in range(8):
            flipped = bytearray(base)
            flipped[i] ^= 1 << bit
            seen.add(hashing.checksum_host(bytes(flipped)))
    assert len(seen) == 1 + 8 * len(base)
    assert hashing.checksum_host(bytes(base) + b"\0") != ref  # length is part of it
