"""An .npz member's load parses nothing: its header was parsed once, at open.

numpy parses .npy headers with ast.literal_eval, and CPython 3.11's AST construction is not
safe from several threads at once (python/cpython gh-106905: "SystemError: AST constructor
recursion depth mismatch"); compare loads members on a thread pool.
"""

from __future__ import annotations

import ast
import io
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import dmlib
from dmlib.errors import FormatError


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "c": rng.standard_normal((5, 7)).astype(np.float32),
        "f": np.asfortranarray(rng.standard_normal((4, 6))),  # stored column-major
        "i": np.arange(24, dtype=np.int16).reshape(2, 3, 4),
        "s": np.float64(2.5),
    }


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_loads_parse_no_header_and_match_numpy(tmp_path, monkeypatch, save) -> None:
    arrays = _arrays()
    path = tmp_path / "x.npz"
    save(path, **arrays)
    with dmlib.open_tensors(path) as ts:

        def refuse(*_a, **_k):
            raise AssertionError("a header was parsed after open")

        monkeypatch.setattr(ast, "literal_eval", refuse)
        with ThreadPoolExecutor(8) as pool:
            got = dict(zip(arrays, pool.map(lambda n: ts[n].load(), arrays)))
    monkeypatch.undo()
    with np.load(path) as oracle:  # numpy's own reader
        for name in arrays:
            want = oracle[name]
            assert got[name].dtype == want.dtype and got[name].shape == want.shape
            assert np.array_equal(got[name], want), name


def test_a_member_rewritten_after_open_is_refused(tmp_path) -> None:
    path = tmp_path / "x.npz"
    np.savez(path, w=np.zeros(8, np.float32))
    ts = dmlib.open_tensors(path)
    try:
        buf = io.BytesIO()  # same size, another header: float32 x 8 -> int32 x 8
        np.lib.format.write_array(buf, np.zeros(8, np.int32))
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("w.npy", buf.getvalue())
        with pytest.raises(FormatError, match="changed while reading"):
            ts["w"].load()
    finally:
        ts.close()
