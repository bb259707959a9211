"""Capture digests: the scheme each boundary names, shared digests, the device checksum.

Oracles: the ``xxhash`` and ``blake3`` packages and :func:`dmlib.hashing.checksum_host` (numpy) on bytes
taken by plain torch forward hooks of our own, cloned at the moment each hook runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _support.tree import SCHEME, leaf, tree_request  # noqa: E402
from torch import nn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.hashing import checksum_host  # noqa: E402

B, S, BLOCK = 2, 7, 3  # two batch rows of 7 positions, blocks of 3 positions


class Bump(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)  # in place: the output is the input object, one version later


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 6)
        self.same = nn.Identity()  # hands its input object on unchanged
        self.lin = nn.Linear(6, 6)
        self.bump = Bump()
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.bump(self.lin(self.same(self.emb(ids))))
        return self.head(y.mean(dim=1))


# request "u" fills batch row 0 (positions 0..6); "v" row 1 positions 0..4, two padding rows
ROWS = [[("u", j) for j in range(S)], [("v", j) for j in range(5)] + [None, None]]


def _model() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(3)
    ids = torch.randint(1, 40, (B, S))
    return Net().eval(), ids


def _seen(model: Net, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Boundary name -> its bytes, cloned when the hook runs (no dmlib involved)."""
    seen: dict[str, np.ndarray] = {}
    hooks = []
    for name in ("emb", "same", "lin", "bump", "head"):
        mod = getattr(model, name)
        hooks.append(mod.register_forward_pre_hook(
            lambda m, a, n=name: seen.__setitem__(f"{n}:input0", a[0].detach().clone().numpy())))  # fmt: skip
        hooks.append(mod.register_forward_hook(
            lambda m, a, o, n=name: seen.__setitem__(n, o.detach().clone().numpy())))  # fmt: skip
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def _capture(model: Net, ids: torch.Tensor, path, *, device_path: bool = False, **kw):
    with torch.no_grad(), dmlib.capture(
        model, path, modules=["emb", "same", "lin", "bump", "head"], row_map=ROWS,
        block_rows=BLOCK, **kw,
    ) as rec:  # fmt: skip
        rec._device_path_on_cpu = device_path
        model(ids)
    return dmlib.open_capture(path)


def _expect(
    x: np.ndarray, fn, tree: str | None = None
) -> tuple[str, dict[str, tuple[str, list[str]]]]:
    """Whole digest and per-request (digest, blocks) of a (B, S, ...) boundary, by hand
    (``tree``: a request's digest is that tree scheme's over its blocks)."""
    reqs = {"u": x[0, :S], "v": x[1, :5]}
    out = {}
    for r, rows in reqs.items():
        blocks = [fn(rows[i : i + BLOCK].tobytes()) for i in range(0, len(rows), BLOCK)]
        out[r] = (tree_request(rows, BLOCK, tree)[0] if tree else fn(rows.tobytes()), blocks)
    return fn(x.tobytes()), out


def _ck(data: bytes) -> str:
    return checksum_host(data).split(":", 1)[1]


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("scheme", ["xxh3", "blake3"])
def test_host_digests_are_the_hash_of_each_boundary_bytes(tmp_path, threads, scheme):
    model, ids = _model()
    seen = _seen(model, ids)
    c = _capture(model, ids, tmp_path / "c", hash_threads=threads, hash=scheme)
    assert c.manifest["version"] == 4 and c.manifest["hash"] == SCHEME[scheme]

    def fn(data: bytes) -> str:
        return leaf(data, scheme)

    for name in ("emb", "same:input0", "same", "lin:input0", "lin", "bump:input0", "bump"):
        b = c.boundary(name)
        whole, reqs = _expect(seen[name], fn, tree=scheme)
        assert b.hash == SCHEME[scheme] and b.digest == whole, name
        for r, (digest, blocks) in reqs.items():
            assert (b.requests[r].digest, b.requests[r].blocks) == (digest, blocks), (name, r)
    # the in-place op: its input and output are one object, before and after the write
    assert c.boundary("bump:input0").digest != c.boundary("bump").digest
    # the pooled head (per sequence): one digest per batch row
    assert c.boundary("head").leading == [fn(row.tobytes()) for row in seen["head"]]


def test_one_tensor_recorded_twice_shares_its_dump(tmp_path):
    model, ids = _model()
    seen = _seen(model, ids)
    c = _capture(model, ids, tmp_path / "c", dump="*")
    m = {b["name"]: b for b in c.manifest["boundaries"]}
    # emb's output is the object `same` receives and returns: one file, three boundaries
    assert m["emb"]["dump"]["file"] == m["same:input0"]["dump"]["file"] == m["same"]["dump"]["file"]
    assert m["bump:input0"]["dump"]["file"] != m["bump"]["dump"]["file"]
    for name in ("emb", "same", "bump:input0", "bump"):
        np.testing.assert_array_equal(c.tensor(name), seen[name])
        np.testing.assert_array_equal(c.tensor(name, "v"), seen[name][1, :5])


def test_device_path_equals_the_host_checksum(tmp_path):
    # the device path (torch ops) run on CPU tensors, against the numpy reference
    model, ids = _model()
    seen = _seen(model, ids)
    c = _capture(model, ids, tmp_path / "d", device_path=True)
    for name in ("emb", "same", "lin:input0", "bump:input0", "bump"):
        b = c.boundary(name)
        whole, reqs = _expect(seen[name], _ck)
        assert b.hash == "cksum4-v1" and b.digest == whole, name
        for r, (digest, blocks) in reqs.items():
            assert (b.requests[r].digest, b.requests[r].blocks) == (digest, blocks), (name, r)
    assert c.boundary("head").leading == [_ck(row.tobytes()) for row in seen["head"]]
    assert c.boundary("emb:input0").digest == _ck(ids.numpy().tobytes())
    # two device-path captures of one input are judged identical, boundary by boundary
    again = _capture(model, ids, tmp_path / "d2", device_path=True)
    df = dmlib.compare_captures(c, again, repeat=again)
    assert df.attrs["status"] == "identical" and df["identical"].all()
    assert df.attrs["repeat_control"]["held"] is True


def test_two_schemes_are_never_called_identical(tmp_path):
    model, ids = _model()
    host = _capture(model, ids, tmp_path / "h")
    dev = _capture(model, ids, tmp_path / "d", device_path=True)
    df = dmlib.compare_captures(host, dev, repeat=dev)
    assert df["identical"].isna().all()
    assert df.attrs["status"] == "inconclusive"
    assert "hashed with xxh3-128-tree-v1 in A, cksum4-v1 in B" in df["note"].iloc[0]
    rc = df.attrs["repeat_control"]["checks"][0]
    assert rc["held"] is False and rc["n_incomparable"] == len(host) and rc["n_differing"] == 0
    assert df.attrs["valid"] is False
    assert "not comparable" in dmlib.localize.boundaries.capture_verdict(df)


def test_version_1_sha256_capture_still_reads_and_compares(tmp_path):
    # a version-1 manifest (bare SHA-256 under "sha256"), written by hand from the bytes
    model, ids = _model()
    seen = _seen(model, ids)
    new = _capture(model, ids, tmp_path / "new")
    old = tmp_path / "old"
    old.mkdir()
    m = json.loads((tmp_path / "new" / "manifest.json").read_text())
    m["version"] = 1
    del m["hash"]
    import hashlib

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    for e in m["boundaries"]:
        x = seen[e["name"]] if e["name"] in seen else ids.numpy()
        del e["hash"], e["digest"]
        e["sha256"] = sha(x.tobytes())
        if e["requests"]:
            _, reqs = _expect(x, sha)
            e["requests"] = {r: {"sha256": d, "n_rows": len(bl) and {"u": 7, "v": 5}[r], "blocks": bl}
                             for r, (d, bl) in reqs.items()}  # fmt: skip
        if e["leading"] is not None:
            e["leading"] = [sha(row.tobytes()) for row in x]
    (old / "manifest.json").write_text(json.dumps(m))
    c = dmlib.open_capture(old)
    assert {b.hash for b in c} == {"sha256"}
    assert dmlib.compare_captures(old, tmp_path / "old")["identical"].all()
    df = dmlib.compare_captures(old, new)
    assert df.attrs["status"] == "inconclusive" and df.attrs["n_comparable"] == 0
    # a version-2 manifest naming an unknown scheme is refused, naming the file
    m2 = json.loads((tmp_path / "new" / "manifest.json").read_text())
    m2["boundaries"][0]["hash"] = "md5"
    (tmp_path / "new" / "manifest.json").write_text(json.dumps(m2))
    with pytest.raises(dmlib.errors.CaptureError, match="md5"):
        dmlib.open_capture(tmp_path / "new")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int16, torch.float64, torch.bool]
)
def test_row_sums_give_the_host_checksum_of_any_run_of_rows(dtype):
    from dmlib.hashing import checksum_of_rows, row_moments_torch

    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (9, 4 * 8), generator=gen, dtype=torch.uint8)
    rows = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
    m = row_moments_torch(rows)
    by_row = [rows[i].numpy().tobytes() if dtype == torch.bool else raw[i].numpy().tobytes()
              for i in range(9)]  # fmt: skip
    row_bytes = len(by_row[0])
    for idx in ([0, 1, 2, 3, 4, 5, 6, 7, 8], [7, 2, 2, 5], [3], []):
        expect = checksum_host(b"".join(by_row[i] for i in idx))
        assert checksum_of_rows(m[idx], row_bytes) == expect, idx


def test_row_sums_refuse_rows_of_odd_bytes():
    from dmlib.hashing import row_moments_torch

    with pytest.raises(ValueError, match="odd"):
        row_moments_torch(torch.zeros((2, 3), dtype=torch.uint8))
