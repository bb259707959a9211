"""The capture's fast paths (commit "every host digest of a boundary in one compiled call").

- ``treehash.hash_boundary`` (whole digest, per-slice digests, per-request dicts) against
  the independent ``xxh3-128-tree-v1`` / ``blake3-tree-v1`` oracles of tests/_support/tree.py
  (``leaf``, ``tree_request``: the xxhash and blake3 packages), plus its refusals (None
  over one piece, ValueError for bad spans and sizes);
- ``treehash.direct_xxh3``: once XXH3 is called directly, digests of unaligned buffers of
  lengths 0..300 and larger still equal the xxhash package's; any other hasher is still
  called (a reversed-input hasher gives the reversed-input digests);
- the manifest file's text: parsed, it equals ``rec.manifest(complete=True)`` through
  ``json`` (same top-level key order, "boundaries" last); ``RowMap.json_text()`` equals
  ``json.dumps(to_json(), separators=(",", ":"))``; out-of-order entries give rows in
  position order, duplicated or gapped positions are refused (hand-checked);
- recapturing with ``overwrite=True`` leaves one ``manifest.json`` whose digests are the
  oracle's ``leaf`` of the outputs a plain forward hook saw; a folder holding only a
  capture's ``manifest.json.tmp`` counts as a capture, one holding another ``.tmp`` does not.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import xxhash
from _support.tree import leaf
from _support.tree import tree_request as oracle_tree

from dmlib import hashing
from dmlib.errors import CaptureError
from dmlib.localize.capture import treehash
from dmlib.localize.captures import TREE_REQUEST_TAG, XXH_REQUEST_TAG, RowMap

torch = pytest.importorskip("torch")
from _support.twolinear import Tiny  # noqa: E402
from torch import nn  # noqa: E402

import dmlib  # noqa: E402

compiled = pytest.mark.skipif(
    not treehash.USE_COMPILED or not treehash._BOUNDARY,
    reason="dmlib.kernels._fused not built (or built without hash_boundary)",
)

#: scheme -> (hasher, tag, piece, digest size) as the capture passes them
ARGS = {
    "xxh3": (xxhash.xxh3_128_digest, XXH_REQUEST_TAG, sys.maxsize, 16),
    "blake3": (hashing._blake3(), TREE_REQUEST_TAG, hashing.PIECE, 32),
}
ODD_IDS = ['a"b', "é", "</script>", "all"]


def _spans(n: int) -> list[tuple[str, int, int]]:
    spans = [(ODD_IDS[0], 0, n // 3), (ODD_IDS[1], n // 3, n - n // 3), (ODD_IDS[2], n - 1, 1)]
    return [s for s in spans if s[2] > 0] + [(ODD_IDS[3], 0, n)]


def _expected(rows: np.ndarray, spans, block: int, scheme: str) -> dict:
    out = {}
    for rid, start, n in spans:
        digest, blocks = oracle_tree(rows[start : start + n], block, scheme)
        out[rid] = {"digest": digest, "n_rows": n, "blocks": blocks}
    return out


@compiled
@pytest.mark.parametrize("scheme", ["xxh3", "blake3"])
@pytest.mark.parametrize(
    ("row_bytes", "n_rows", "block"),
    [(256, 40, 64), (12, 97, 7), (7, 45, 8), (4, 1, 64), (1000, 13, 4), (3, 2, 1)],
)
def test_hash_boundary_matches_the_oracle(row_bytes, n_rows, block, scheme):
    rng = np.random.default_rng(row_bytes * 1000 + n_rows)
    buf = rng.integers(0, 256, row_bytes * n_rows, dtype=np.uint8)
    rows = buf.reshape(n_rows, row_bytes)
    hasher, tag, piece, size = ARGS[scheme]
    spans = _spans(n_rows)
    for n_lead in sorted({0, 1, n_rows}):
        got = treehash.hash_boundary(hasher, buf.data, n_lead, buf.data, row_bytes, spans, block,
                                     tag, piece, size)  # fmt: skip
        assert got is not None
        whole, lead, reqs = got
        assert whole == leaf(buf.tobytes(), scheme)
        step = len(buf) // n_lead if n_lead else 0
        assert lead == [leaf(buf[i * step : (i + 1) * step].tobytes(), scheme)
                        for i in range(n_lead)]  # fmt: skip
        assert reqs == _expected(rows, spans, block, scheme)
        assert list(reqs) == [s[0] for s in spans]


@compiled
@pytest.mark.parametrize("scheme", ["xxh3", "blake3"])
def test_hash_boundary_reads_requests_from_their_own_buffer(scheme):
    # a (batch, positions, dim) tensor: whole in C order, the rows with positions moved first
    x = np.random.default_rng(5).standard_normal((3, 10, 5)).astype(np.float32)
    moved = np.ascontiguousarray(x.transpose(1, 0, 2)).reshape(10, 15)
    hasher, tag, piece, size = ARGS[scheme]
    spans = [("p", 0, 4), ("q", 4, 6)]
    whole, lead, reqs = treehash.hash_boundary(hasher, x.reshape(-1).view(np.uint8).data, 3,
                                               moved.view(np.uint8).reshape(-1).data, 60, spans, 3,
                                               tag, piece, size)  # fmt: skip
    assert whole == leaf(x, scheme) and lead == [leaf(x[i], scheme) for i in range(3)]
    assert reqs == _expected(moved, spans, 3, scheme)
    # n_lead=-1: no slices; rows=None: no requests
    got = treehash.hash_boundary(hasher, x.tobytes(), -1, None, 60, spans, 3, tag, piece, size)
    assert got == (leaf(x, scheme), None, None)


@compiled
def test_hash_boundary_defers_over_a_piece_and_refuses_bad_arguments():
    buf = np.arange(40, dtype=np.uint8)
    b3, tag, _, _ = ARGS["blake3"]

    def call(whole=buf.data, n_lead=-1, rows=buf.data, row_bytes=4, spans=(("r", 0, 3),),
             block=4, piece=hashing.PIECE, size=32):  # fmt: skip
        return treehash.hash_boundary(b3, whole, n_lead, rows, row_bytes, list(spans), block,
                                      tag, piece, size)  # fmt: skip

    assert call(piece=39) is None  # the whole buffer over one piece
    assert call(piece=40, block=11) is None  # a block (44 bytes) over one piece
    assert call(piece=40, block=11, rows=None) == (leaf(buf.tobytes(), "blake3"), None, None)
    for bad in [("r", 9, 2), ("r", -1, 1), ("r", 10, 1), ("r", 0, 11)]:
        with pytest.raises(ValueError, match="outside the buffer"):
            call(spans=[bad])
    with pytest.raises(ValueError):
        call(spans=[("r", 0, 0)])  # a request of no rows
    with pytest.raises(ValueError, match="inconsistent"):
        call(n_lead=3)  # 40 bytes in 3 slices
    for size in (0, 65):
        with pytest.raises(ValueError, match="inconsistent"):
            call(size=size)
    with pytest.raises(ValueError, match="not 16 bytes"):  # BLAKE3's 32 bytes announced as 16
        call(size=16)


def _unaligned(n: int, off: int) -> memoryview:
    base = np.random.default_rng(n).integers(0, 256, n + 8, dtype=np.uint8)
    return base[off : off + n].data  # contiguous, at an odd address


@compiled
def test_direct_xxh3_gives_the_xxhash_digests_and_only_for_that_function(monkeypatch):
    fused = treehash._capture
    if not hasattr(fused, "use_xxh3"):
        pytest.skip("the compiled module has no use_xxh3 (built before the direct XXH3 path)")
    monkeypatch.setattr(treehash, "_DIRECT", [])  # checked afresh, whatever ran before
    digest = xxhash.xxh3_128_digest
    assert treehash.direct_xxh3(digest) is True
    _, tag, piece, _ = ARGS["xxh3"]
    for n in [*range(301), 1000, 1024, 4096, 100003]:
        mv = _unaligned(n, 1 + n % 7)
        data = mv.tobytes()
        n_lead = 2 if n % 2 == 0 else 1
        got = treehash.hash_boundary(digest, mv, n_lead, mv, 1, [("r", 0, n)] if n else [],
                                     64, tag, piece, 16)  # fmt: skip
        assert got is not None, n
        assert got[0] == leaf(data), n
        half = n // n_lead
        assert got[1] == [leaf(data[i * half : (i + 1) * half]) for i in range(n_lead)], n
        if n:
            assert got[2] == _expected(np.frombuffer(data, np.uint8).reshape(n, 1),
                                       [("r", 0, n)], 64, "xxh3")  # fmt: skip

    calls = []

    def reversed_xxh3(b):
        calls.append(len(b))
        return xxhash.xxh3_128_digest(bytes(b)[::-1])

    assert treehash.direct_xxh3(reversed_xxh3) is False  # no compiled XXH3 behind it
    assert treehash.direct_xxh3(lambda b: xxhash.xxh3_128_digest(bytes(b)[::-1])) is False
    for n in (0, 5, 17, 300, 4096):
        mv = _unaligned(n, 3)
        data = mv.tobytes()
        calls.clear()
        got = treehash.hash_boundary(reversed_xxh3, mv, -1, None, 1, [], 64, tag, piece, 16)
        assert calls == [n]  # called, not bypassed
        assert got == (xxhash.xxh3_128_digest(data[::-1]).hex(), None, None)
        # the registered function still gives XXH3's digests (directly or through Python)
        assert treehash.hash_boundary(digest, mv, -1, None, 1, [], 64, tag, piece, 16) == (
            leaf(data), None, None)  # fmt: skip
    # a failed check of another function leaves XXH3's registration as it was
    assert treehash.direct_xxh3(digest) is True


#: two batch rows of 8 positions: quoted, non-ASCII and </script> ids, padding, a gap in rows
ROWS = [
    [('a"b', j) for j in range(3)] + [None, ("é", 0), ("é", 1), None, ("a\\b\n", 0)],
    [("</script>", j) for j in range(5)] + [None, ("é", 2), None],
]


def _x(seed: int):
    return torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ops", [False, True])
def test_manifest_text_is_the_manifest_dict(tmp_path, ops):
    model = Tiny().eval()
    with torch.no_grad(), dmlib.capture(model, tmp_path / "c", row_map=ROWS, ops=ops,
                                        block_rows=2) as rec:  # fmt: skip
        model(_x(1))
    text = (tmp_path / "c" / "manifest.json").read_text()
    want = rec.manifest(complete=True)
    assert json.loads(text) == json.loads(json.dumps(want))
    assert list(json.loads(text)) == [k for k in want if k != "boundaries"] + ["boundaries"]
    assert json.loads(text)["row_map"] == [None if e is None else list(e)
                                           for r in ROWS for e in r]  # fmt: skip


ENTRIES = [[e for r in ROWS for e in r], [("a", 1), ("a", 0), None, ("b", 0)], [], [None],
           [(3, 0), ("3", 1), ("\u2028\x00", 0)]]  # fmt: skip


@pytest.mark.parametrize("entries", ENTRIES)
def test_row_map_json_text_is_compact_json(entries):
    rm = RowMap(entries)
    assert rm.json_text() == json.dumps(rm.to_json(), separators=(",", ":"))
    assert rm.json_text() == rm.json_text()  # made once, the same text again


def test_row_map_rows_in_position_order_and_bad_positions_refused():
    rm = RowMap([("a", 1), ("a", 0), None, ("b", 0)])
    assert rm.requests["a"].tolist() == [1, 0] and rm.requests["b"].tolist() == [3]
    assert rm.to_json() == [["a", 1], ["a", 0], None, ["b", 0]]
    for bad in ([("a", 0), ("a", 0)], [("a", 0), ("a", 2)], [("a", 1), ("a", 0), ("a", 1)],
                [("a", 1)], [("a", 2), None, ("a", 0)]):  # fmt: skip
        with pytest.raises(CaptureError, match="positions"):
            RowMap(bad)


def _outputs(model) -> tuple[dict, list]:
    seen: dict[str, np.ndarray] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o.numpy().copy()))
             for n, m in (("a", model.a), ("b", model.b))]  # fmt: skip
    return seen, hooks


def _check_digests(folder, seen) -> None:
    man = json.loads((folder / "manifest.json").read_text())
    assert man["complete"] is True
    by_name = {b["name"]: b for b in man["boundaries"]}
    for name, out in seen.items():
        b = by_name[name]
        assert b["digest"] == leaf(out)
        assert b["requests"]["</script>"]["digest"] == oracle_tree(out[1, :5], 2)[0]
        assert b["requests"]['a"b']["digest"] == oracle_tree(out[0, :3], 2)[0]


def test_recapture_with_overwrite_twice_leaves_one_manifest_of_the_new_input(tmp_path):
    model = Tiny().eval()
    folder = tmp_path / "c"
    seen, hooks = _outputs(model)
    for i, overwrite in enumerate([False, True, True]):
        with torch.no_grad(), dmlib.capture(model, folder, row_map=ROWS, overwrite=overwrite,
                                            block_rows=2):  # fmt: skip
            model(_x(10 + i))
        assert sorted(os.listdir(folder)) == ["manifest.json"]
        _check_digests(folder, seen)
    for h in hooks:
        h.remove()


def test_a_capture_left_under_the_temporary_name_counts_as_a_capture(tmp_path):
    model = Tiny().eval()
    folder = tmp_path / "c"
    with torch.no_grad(), dmlib.capture(model, folder, row_map=ROWS, block_rows=2):
        model(_x(1))
    # as a run stopped between removing the old manifest and the rename leaves it
    (folder / "manifest.json.tmp").write_bytes((folder / "manifest.json").read_bytes())
    (folder / "manifest.json").unlink()
    with pytest.raises(CaptureError, match="capture already exists"):
        with torch.no_grad(), dmlib.capture(model, folder, row_map=ROWS):
            model(_x(2))
    assert sorted(os.listdir(folder)) == ["manifest.json.tmp"]
    seen, hooks = _outputs(model)
    with torch.no_grad(), dmlib.capture(model, folder, row_map=ROWS, overwrite=True, block_rows=2):
        model(_x(2))
    for h in hooks:
        h.remove()
    assert sorted(os.listdir(folder)) == ["manifest.json"]
    _check_digests(folder, seen)


def test_another_temporary_file_is_not_a_capture(tmp_path):
    model = Tiny().eval()
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "manifest.json.tmp").write_text("hello")
    with pytest.raises(CaptureError, match="replaces only a capture"):
        with torch.no_grad(), dmlib.capture(model, folder, row_map=ROWS, overwrite=True):
            model(_x(1))
    assert sorted(os.listdir(folder)) == ["manifest.json.tmp"]
    assert (folder / "manifest.json.tmp").read_text() == "hello"


class Tile(nn.Module):
    def forward(self, x):
        return x.repeat(1, 1, 8192)  # (2, 8, 49152) float32: 3 MiB, hashed on a worker


class Mixed(nn.Module):
    """Boundaries of every kind the capture's paths tell apart: a bfloat16 layer, a tensor
    over 1 MiB (hashed on a worker from a copy), a non-contiguous output, a pooled head
    (one row per sequence: per-index digests) and, with the row map below, a request on
    rows that are not consecutive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.tile = Tile()
        self.bf16 = nn.Linear(6, 6).to(torch.bfloat16)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        big = self.tile(x)
        h = self.bf16(x.to(torch.bfloat16)).float()
        mixed = (big[:, :, :6] + h).transpose(0, 1).contiguous().transpose(0, 1)
        return self.head(h.mean(dim=1)), mixed


@pytest.mark.parametrize("scheme", ["xxh3", "blake3"])
def test_every_path_gives_the_oracles_digests_with_and_without_the_compiled_module(
    tmp_path, monkeypatch, scheme
):
    """With XXH3 the 3 MiB tensor is hashed in the hook (no worker is started); with BLAKE3
    it is copied and hashed on a worker. Both against the oracles."""
    from dmlib.localize.capture import recorder as capture_mod

    pools = []

    class Counted(capture_mod.ThreadPoolExecutor):
        def submit(self, *a, **k):
            pools.append(self)
            return super().submit(*a, **k)

    monkeypatch.setattr(capture_mod, "ThreadPoolExecutor", Counted)
    model = Mixed().eval()
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(4))
    rows = [
        [("r0", j) for j in range(7)] + [None],
        [("r1", j) for j in range(3)] + [("g", 0), None, ("g", 1), ("g", 2), None],
    ]
    where = {"r0": [(0, j) for j in range(7)], "r1": [(1, j) for j in range(3)],
             "g": [(1, 3), (1, 5), (1, 6)]}  # fmt: skip
    manifests = []
    for use in (True, False):
        monkeypatch.setattr(treehash, "USE_COMPILED", use and treehash.USE_COMPILED)
        with torch.no_grad(), dmlib.capture(model, tmp_path / str(use), row_map=rows,
                                            block_rows=2, modules=["", "*"], hash=scheme):  # fmt: skip
            model(x)
        manifests.append(json.loads((tmp_path / str(use) / "manifest.json").read_text()))
    assert manifests[0] == manifests[1]  # compiled and Python paths: the same manifest
    assert bool(pools) == (scheme == "blake3")  # the worker: only where hashing is slow
    by_name = {b["name"]: b for b in manifests[0]["boundaries"]}
    with torch.no_grad():  # the test's own forward, piece by piece
        tile = x.repeat(1, 1, 8192).numpy()
        half_t = model.bf16(x.to(torch.bfloat16))
        half = half_t.view(torch.int16).numpy()  # bfloat16 as its bits
        head = model.head(half_t.float().mean(dim=1)).numpy()
        mixed = (torch.from_numpy(tile[:, :, :6]) + half_t.float()).numpy()

    def check(name: str, arr: np.ndarray, dtype: str) -> None:
        b = by_name[name]
        assert b["dtype"] == dtype and b["digest"] == leaf(arr, scheme), name
        for rid, pos in where.items():
            mine = np.stack([arr[r, j] for r, j in pos])
            got = b["requests"][rid]
            assert (got["digest"], got["blocks"]) == oracle_tree(mine, 2, scheme), (name, rid)

    check("tile", tile, "float32")  # 3 MiB: in the hook (xxh3), a worker's copy (blake3)
    check("bf16", half, "bfloat16")
    with torch.no_grad():
        assert not model(x)[1].is_contiguous()
    check("(model):output1", mixed, "float32")  # non-contiguous: made contiguous first
    assert by_name["tile"]["shape"] == [2, 8, 49152]
    b = by_name["(model)"]  # the pooled head's logits, (2, 3): one digest per sequence
    assert b["row_dims"] is None and b["leading"] == [leaf(head[0], scheme), leaf(head[1], scheme)]


class Embed(nn.Module):
    """(batch, seq) token ids -> (batch, seq, 4): a row-mapped output of any layout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(50, 4)

    def forward(self, ids):
        return self.emb(ids)


def test_a_row_map_seen_before_is_shared_but_its_batch_is_each_captures_own(tmp_path):
    from dmlib.localize.capture import rowmap as captures_mod

    flat = [("r", j) for j in range(400)]  # no batch size given: each capture learns its own
    a, b = RowMap.shared(list(flat)), RowMap.shared(list(flat))
    assert a is not b and a._memo is b._memo and a.requests is b.requests
    a.batch = 5
    assert RowMap.shared(list(flat)).batch is None and b.batch is None
    model = Embed().eval()
    ids = torch.arange(400).reshape(5, 80) % 50
    with torch.no_grad():
        with dmlib.capture(model, tmp_path / "five", row_map=flat):
            model(ids)
        with dmlib.capture(model, tmp_path / "four", row_map=flat):  # (4, 100): another batch
            model(ids.reshape(4, 100))
    for name, batch in (("five", 5), ("four", 4)):
        man = json.loads((tmp_path / name / "manifest.json").read_text())
        assert man["batch"] == batch
        (emb,) = [x for x in man["boundaries"] if x["name"] == "emb"]
        out = model.emb(ids.reshape(batch, -1)).detach().numpy()
        assert emb["requests"]["r"]["digest"] == oracle_tree(out.reshape(400, 4), 64)[0]
    assert captures_mod._SHARED  # (the capture took its row maps through RowMap.shared)


@pytest.mark.parametrize(
    "other",
    [
        [(3.0, 0), (3.0, 1)],  # equal to (3, 0) as Python values, but request "3.0"
        [(True, 0), (True, 1)],  # equal to (1, 0), but request "True"
        [[3, 0], [3, 1]],  # JSON-style pairs: not shared, built as they are
    ],
)
def test_only_entries_of_exact_types_are_shared(other):
    first = RowMap.shared([(3, 0), (3, 1)] if other[0][0] != 1 else [(1, 0), (1, 1)])
    again = RowMap.shared(other)
    assert list(again.requests) == [str(other[0][0])]
    assert again._memo is not first._memo


def test_a_shared_row_map_is_not_changed_by_the_callers_list_nor_kept_forever():
    from dmlib.localize.capture import rowmap as captures_mod

    rows = [[("a", 0), ("a", 1)], [("b", 0), None]]
    first = RowMap.shared(rows)
    rows[0][0], rows[0][1] = ("z", 0), ("z", 1)  # the caller's lists change afterwards
    assert first.entries[0] == ("a", 0) and list(RowMap.shared(rows).requests) == ["z", "b"]
    for k in range(captures_mod._SHARED_MAX + 1):  # as many other layouts: the first is dropped
        RowMap.shared([(f"x{k}", 0)])
    assert RowMap.shared([[("a", 0), ("a", 1)], [("b", 0), None]])._memo is not first._memo


def test_the_kv_cache_row_plans_kept_with_a_row_map_are_bounded(tmp_path):
    from dmlib.localize.capture import recorder as capture_mod

    rows = [[("a", j) for j in range(4)], [("b", j) for j in range(4)]]
    rm = RowMap.shared(rows)
    rec = capture_mod.Recorder(tmp_path, row_map=rm, block_rows=2, dump=[], dump_requests=None,
                               metadata={})  # fmt: skip
    # a long generate(): the cache grows by one position a decode step, one plan per length
    plans = {n: rec._cache_rows((2, 1, n, 3)) for n in range(4, 4 + 3 * capture_mod._MEMO_PLANS)}
    kept = [k for k in rm._memo if k[0] == "cache"]
    assert len(kept) == capture_mod._MEMO_PLANS
    # every plan is right, kept with the row map or not: request "a" holds batch row 0's
    # prompt positions, then the tokens generated after it, in position order
    for n, (entries, mine) in plans.items():
        assert len(entries) == 2 * n
        assert mine["a"] == list(range(n)) and mine["b"] == list(range(n, 2 * n))
    assert RowMap.shared(rows)._memo is rm._memo  # a later capture of the layout reuses them


def test_a_prompt_cache_is_read_by_the_row_maps_own_rows(tmp_path):
    """A cache of the prompt's length (prefill): packed rows, padding and positions out of
    order; each request's rows worked out by hand, in position order."""
    from dmlib.localize.capture import recorder as capture_mod

    rows = [[("p", 1), ("p", 0), ("q", 0), None],  # batch row 0: p then q, packed
            [None, ("r", 0), ("r", 2), ("r", 1)],
            [("q", 1), ("s", 0), None, None]]  # fmt: skip
    rec = capture_mod.Recorder(tmp_path, row_map=RowMap(rows), block_rows=2, dump=[],
                               dump_requests=None, metadata={})  # fmt: skip
    entries, mine = rec._cache_rows((3, 2, 4, 5))
    assert entries == [e for row in rows for e in row]
    assert mine == {"p": [1, 0], "q": [2, 8], "r": [5, 7, 6], "s": [9]}
    assert list(mine) == ["p", "q", "r", "s"]  # first seen first
    assert rec._cache_rows((3, 2, 4)) is None and rec._cache_rows((2, 2, 4, 5)) is None


class Attention(nn.Module):
    """Op tensors read per request by row axes, in every memory layout an attention block
    makes: a ``transpose(1, 2)`` view of ``(batch, positions, heads, head_dim)`` (its rows
    lie in C order: no copy), the same made contiguous (rows gathered), grouped-KV heads
    repeated (``kv_repeat``), ``(batch, head_dim, positions)`` (axes 0 and 2 of 3 dims) and
    K transposed (``(batch, heads, head_dim, positions)``: axes 0 and 3)."""

    def forward(self, x):
        b, s, f = x.shape  # f = 8: 4 heads of 2, or 2 KV heads of 2 repeated twice
        q = x.view(b, s, 4, 2).transpose(1, 2)
        k = (x[..., :4] * 2.0).view(b, s, 2, 2).transpose(1, 2).contiguous()
        kk = k.repeat_interleave(2, dim=1)  # (b, 4, s, 2): heads 0,0,1,1
        kt = kk.transpose(-1, -2) * 1.0  # (b, 4, 2, s)
        y = q * 0.5 + kk
        z = x.transpose(1, 2) - 1.0  # (b, 8, s)
        return y.transpose(1, 2).reshape(b, s, f) + z.transpose(1, 2) + kt.sum() * 0.0


def _row_axes_oracle(arr: np.ndarray, axes, row_map: RowMap, block: int) -> dict:
    """Per-request digests of ``arr`` read by ``axes``, from the test's own moveaxis."""
    rows = np.moveaxis(arr, axes, (0, 1)).reshape(len(row_map), -1)
    out = {}
    for rid, idx in row_map.requests.items():
        digest, blocks = oracle_tree(rows[idx], block)
        out[rid] = {"digest": digest, "n_rows": len(idx), "blocks": blocks}
    return out


@pytest.mark.parametrize("use_compiled", [True, False])
def test_row_axes_op_tensors_give_the_oracles_digests(tmp_path, monkeypatch, use_compiled):
    """Every op boundary's digests (whole, per request, kv_repeat) against the test's oracle
    applied to the tensor the same forward dumped (the dump is written by another path)."""
    monkeypatch.setattr(treehash, "USE_COMPILED", use_compiled and treehash.USE_COMPILED)
    b, s = 3, 7
    x = torch.randn(b, s, 8, generator=torch.Generator().manual_seed(6))
    rows = [[("a", j) for j in range(7)],
            [("b", j) for j in range(5)] + [None, None],
            [None] + [("c", j) for j in range(6)]]  # fmt: skip
    m = Attention().eval()
    for name, dump in (("hashed", None), ("dumped", "*")):
        with torch.no_grad(), dmlib.capture(m, tmp_path / name, modules="", row_map=rows,
                                            ops=True, block_rows=4, dump=dump):  # fmt: skip
            m(x)
    hashed = json.loads((tmp_path / "hashed" / "manifest.json").read_text())["boundaries"]
    dumped = dmlib.open_capture(tmp_path / "dumped")
    rm = RowMap(rows)
    seen = set()
    for entry in hashed:
        arr = dumped.tensor(entry["name"])
        assert entry["digest"] == leaf(arr), entry["name"]
        axes = entry.get("row_axes")
        if axes is None:
            continue
        seen.add((tuple(entry["shape"]), tuple(axes)))
        assert entry["requests"] == _row_axes_oracle(arr, tuple(axes), rm, 4), entry["name"]
        if len(axes) == 2 and axes == [0, 2] and arr.ndim == 4:
            kv = entry["kv_repeat"]
            heads = arr.shape[1]
            g = 2 if np.array_equal(arr[:, 0::2], arr[:, 1::2]) and heads == 4 else 1
            assert kv["groups"] == g, entry["name"]
            if g == 2:
                assert kv["requests"] == {
                    rid: {k: v for k, v in d.items()}
                    for rid, d in _row_axes_oracle(
                        np.ascontiguousarray(arr[:, 0::2]), (0, 2), rm, 4
                    ).items()
                }
    # the layouts named in the docstring were all read by rows
    assert {((3, 4, 7, 2), (0, 2)), ((3, 2, 7, 2), (0, 2)), ((3, 8, 7), (0, 2)),
            ((3, 4, 2, 7), (0, 3))} <= seen  # fmt: skip
    kvs = [e for e in hashed if e.get("kv_repeat", {}).get("groups") == 2]
    assert kvs  # the repeated heads were recognised


@pytest.mark.parametrize(
    ("shape", "dtype", "order", "step"),
    [((3, 4, 7, 2), "float32", (0, 2, 1, 3), 1), ((64, 64), "float32", (1, 0), 1),
     ((5, 6), "float64", (1, 0), 2), ((4, 3, 5), "uint8", (2, 0, 1), 1),
     ((2, 3, 4, 5, 6), "float16", (4, 1, 3, 0, 2), 1), ((7,), "int64", (0,), 3),
     ((3, 1, 4), "complex128", (2, 1, 0), 1), ((0, 4), "float32", (1, 0), 1),
     ((2, 3), "bool", (1, 0), 1)],
)  # fmt: skip
def test_contiguous_copies_as_numpy_does(shape, dtype, order, step):
    base = np.arange(int(np.prod(shape)) * step ** len(shape), dtype=np.int64)
    base = (base * 7919 % 251).astype(dtype).reshape(tuple(n * step for n in shape))
    view = base[tuple(slice(None, None, step) for _ in shape)].transpose(order)
    got = treehash.contiguous(view)
    want = np.ascontiguousarray(view)
    assert got.flags.c_contiguous and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert treehash.contiguous(want) is want  # already C order: no copy


@pytest.mark.parametrize(
    ("shape", "to", "order"),
    [((1, 4), (3, 4), (0, 1)), ((3, 1), (3, 5), (1, 0)), ((1, 1), (2, 3), (0, 1)),
     ((2, 1, 3), (2, 4, 3), (1, 2, 0))],
)  # fmt: skip
def test_contiguous_copies_broadcast_views(shape, to, order):
    """Views with zero strides (numpy.broadcast_to): every repeated item copied."""
    base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 1.5
    view = np.broadcast_to(base, to).transpose(order)
    got = treehash.contiguous(view)
    assert got.flags.c_contiguous and got.tobytes() == np.ascontiguousarray(view).tobytes()


@compiled
def test_gather_refuses_buffers_of_another_size():
    with pytest.raises(ValueError, match="differ in size"):
        treehash._capture.gather(np.zeros((3, 4), np.float32).T, np.zeros(11, np.float32))


class Lazy(nn.Module):
    """Outputs that are lazy views: a conjugate (complex) and its imaginary part, which
    torch keeps as a negative view of the same memory."""

    def forward(self, x):
        c = torch.complex(x, x * 2.0)
        return c.conj(), c.conj().imag


def test_lazy_conjugate_and_negative_views_are_hashed_by_their_values(tmp_path):
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(8))
    rows = [[("a", j) for j in range(4)], [("b", j) for j in range(4)]]
    m = Lazy()
    with torch.no_grad():
        conj, imag = m(x)
        assert conj.is_conj() and imag.is_neg()  # what the capture receives
        with dmlib.capture(m, tmp_path / "c", modules="", row_map=rows, block_rows=2):
            m(x)
    by_name = {b["name"]: b for b in json.loads((tmp_path / "c" / "manifest.json").read_text())
               ["boundaries"]}  # fmt: skip
    want_conj = (x.numpy() - 2j * x.numpy()).astype(np.complex64)  # by hand
    want_imag = -2.0 * x.numpy()
    for name, want in (("(model)", want_conj), ("(model):output1", want_imag)):
        b = by_name[name]
        assert b["digest"] == leaf(want), name
        assert b["requests"]["b"]["digest"] == oracle_tree(want[1], 2)[0], name
