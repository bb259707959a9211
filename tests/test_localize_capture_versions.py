"""Captures of format versions 2, 3 and 4 read and compare together, never falsely.

Version 3 (``blake3-tree-v1``) derives a request's digest from its blocks; version 2
(``blake3-64MiB``) hashed the request's rows again; version 4 writes ``xxh3-128-tree-v1``
by default and ``blake3-tree-v1`` with ``hash="blake3"`` (digests as version 3's). The
version-2 captures here are written by the test in the old layout, their digests
computed from the raw bytes of plain forward hooks with the blake3 package (the old
rule: one block, that block's digest; several, BLAKE3 of all the request's rows); the
version-3 ones are ``hash="blake3"`` captures whose manifest says version 3.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _support.tree import tree_request  # noqa: E402
from blake3 import blake3  # noqa: E402
from torch import nn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.localize.captures import lift_blake3  # noqa: E402

B, S, F, BLOCK = 2, 7, 4, 3
ROWS = [[("u", j) for j in range(S)], [("v", j) for j in range(5)] + [None, None]]
MINE = {"u": (0, S), "v": (1, 5)}  # request -> (batch row, positions)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(F, F), nn.Tanh(), nn.Linear(F, F)).eval()


def _x(bump: bool = False) -> torch.Tensor:
    x = torch.randn(B, S, F, generator=torch.Generator().manual_seed(1))
    if bump:  # request v, position 4: its second block
        x[1, 4, 0] = torch.nextafter(x[1, 4, 0], torch.tensor(9.0))
    return x


def _capture(path, bump: bool = False, scheme: str = "blake3"):
    """A version-3 capture (``scheme="xxh3"``: a default version-4 one), and the bytes
    every boundary saw (plain hooks)."""
    model, seen = _model(), {}
    hooks = []
    for n, m in model.named_children():
        hooks.append(
            m.register_forward_pre_hook(
                lambda mod, a, n=n: seen.__setitem__(f"{n}:input0", a[0].detach().clone().numpy())
            )
        )
        hooks.append(m.register_forward_hook(
            lambda mod, a, o, n=n: seen.__setitem__(n, o.detach().clone().numpy())))  # fmt: skip
    with torch.no_grad(), dmlib.capture(model, path, row_map=ROWS, block_rows=BLOCK, hash=scheme):
        model(_x(bump))
    for h in hooks:
        h.remove()
    if scheme == "blake3":  # version 3 wrote what version 4 writes with hash="blake3"
        m = json.loads((path / "manifest.json").read_text())
        assert m["version"] == 4 and m["hash"] == "blake3-tree-v1"
        (path / "manifest.json").write_text(json.dumps(dict(m, version=3)))
    return path, seen


def _old(rows: np.ndarray) -> tuple[str, list[str]]:
    """Version 2's digests of a request's rows, from their bytes."""
    blocks = [blake3(rows[i : i + BLOCK].tobytes()).hexdigest() for i in range(0, len(rows), BLOCK)]
    return (blocks[0] if len(blocks) == 1 else blake3(rows.tobytes()).hexdigest()), blocks


def _as_version2(src, seen, dst):
    """Write ``src``'s capture as version 2 wrote it, digests from the raw bytes."""
    m = json.loads((src / "manifest.json").read_text())
    m["version"], m["hash"] = 2, "blake3-64MiB"
    assert {d["name"] for d in m["boundaries"]} == set(seen)
    for d in m["boundaries"]:
        d["hash"] = "blake3-64MiB"
        x = seen[d["name"]]
        d["digest"] = blake3(x.tobytes()).hexdigest()
        for r, (row, n) in MINE.items():
            digest, blocks = _old(x[row, :n])
            d["requests"][r] = {"digest": digest, "n_rows": n, "blocks": blocks}
    dst.mkdir()
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    t = tmp_path_factory.mktemp("versions")
    a, seen_a = _capture(t / "a")
    b, seen_b = _capture(t / "b")
    c, seen_c = _capture(t / "c", bump=True)
    x, _ = _capture(t / "x", scheme="xxh3")
    y, _ = _capture(t / "y", bump=True, scheme="xxh3")
    return {
        "a": a, "b": b, "c": c, "seen": seen_a, "x": x, "y": y,
        "b2": _as_version2(b, seen_b, t / "b2"), "c2": _as_version2(c, seen_c, t / "c2"),
    }  # fmt: skip


def test_the_new_version_and_the_old_layout_of_the_test_differ_where_they_should(caps):
    new, old = dmlib.open_capture(caps["a"]), dmlib.open_capture(caps["b2"])
    assert new.manifest["version"] == 3 and old.manifest["version"] == 2
    x = caps["seen"]["0"]
    for b in (new.boundary("0"), old.boundary("0")):
        assert b.digest == blake3(x.tobytes()).hexdigest()  # whole: one rule in both
        assert b.requests["v"].blocks == _old(x[1, :5])[1]  # blocks: one rule in both
    # u has 3 blocks: the version-3 digest is the tree over them, version 2's all rows
    assert new.boundary("0").requests["u"].digest == tree_request(x[0], BLOCK, "blake3")[0]
    assert old.boundary("0").requests["u"].digest == blake3(x[0].tobytes()).hexdigest()
    assert new.boundary("0").requests["u"].digest != old.boundary("0").requests["u"].digest
    # read together, the old capture's request digests are rebuilt from its blocks
    _, lifted = lift_blake3(new, old)
    assert lifted.boundary("0").hash == "blake3-tree-v1"
    assert lifted.boundary("0").requests["u"].digest == tree_request(x[0], BLOCK, "blake3")[0]
    assert old.boundary("0").hash == "blake3-64MiB"  # the capture as read is unchanged


@pytest.mark.parametrize("pair", [("a", "b2"), ("b2", "a"), ("b2", "b2"), ("a", "b"), ("x", "x")])
def test_equal_bytes_are_identical_across_versions(caps, pair):
    df = dmlib.compare_captures(caps[pair[0]], caps[pair[1]], repeat=caps[pair[1]])
    assert df.attrs["status"] == "identical" and df["identical"].all()
    assert not df["note"].fillna("").str.contains("hashed with").any()
    assert df.attrs["repeat_control"]["held"] is True


@pytest.mark.parametrize("pair", [("a", "c2"), ("b2", "c"), ("b2", "c2"), ("a", "c"), ("x", "y")])
def test_a_difference_is_found_alike_across_versions(caps, pair):
    df = dmlib.compare_captures(caps[pair[0]], caps[pair[1]])
    assert df.attrs["status"] == "different"
    assert df.attrs["first_divergent_boundary"] == "0:input0"  # the model's input, bumped
    rows = df.set_index("boundary")
    assert not rows.loc["0:input0", "identical"]
    # u is untouched, v differs in its second block only: (u: blocks 0-2, v: 3-4)
    assert list(rows.loc["0:input0", "diff_blocks"]) == [4]


def test_a_scheme_without_a_common_form_is_not_judged(caps, tmp_path):
    """Version 1 (bare SHA-256) against version 3: never identical, never different."""
    m = json.loads((caps["b2"] / "manifest.json").read_text())
    m["version"] = 1
    for d in m["boundaries"]:
        d.pop("hash")
        d["sha256"] = d.pop("digest")
        for v in d["requests"].values():
            v["sha256"] = v.pop("digest")
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(m))
    df = dmlib.compare_captures(caps["a"], tmp_path / "v1")
    assert df["identical"].isna().all() and df.attrs["status"] == "inconclusive"
    assert "hashed with blake3-tree-v1 in A, sha256 in B" in df["note"].iloc[0]


@pytest.mark.parametrize("old", ["a", "b2"])
def test_the_default_xxh3_capture_meets_a_blake3_one_unjudged_with_the_way_out(caps, old):
    """Version 4's default scheme against versions 3 and 2: equal bytes, but no digest of
    one scheme says anything about the other's: never identical, never different."""
    x = dmlib.open_capture(caps["x"])
    assert x.manifest["version"] == 4 and x.boundary("0").hash == "xxh3-128-tree-v1"
    df = dmlib.compare_captures(caps["x"], caps[old])
    assert df["identical"].isna().all() and df.attrs["status"] == "inconclusive"
    note = df["note"].iloc[0]
    assert "hashed with xxh3-128-tree-v1 in A, " in note and "hash='blake3'" in note
