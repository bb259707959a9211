"""The report's matrix cache trusts only what dmlib signed for these inputs.

A study shared as a folder, or an output folder someone else prepared, may carry a
``cache/matrix-*.json`` under the very name the report looks for (the key is computed
from public facts: the study file, the paths, sizes and times of its inputs). Such a file
(the earlier unsigned format, one signed with another secret, or dmlib's own entry with
its numbers altered) is ignored and the matrix computed again. Expected numbers come from
numpy on the arrays written here, never from dmlib: ``n_diff`` is the count of elements
that differ, and a pair is identical when no element does.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

import dmlib.stats.matrix as stats_matrix
from dmlib import report
from dmlib.report import cache

RUNS = {
    "a": np.array([1.0, 2.0, 4.0, 8.0], dtype="<f4"),
    "b": np.array([1.0, 2.5, 4.0, 9.0], dtype="<f4"),
    "c": np.array([1.0, 2.0, 4.0, 8.0], dtype="<f4"),
}


def _write(path: Path, w: np.ndarray) -> None:
    raw = w.tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(w)], "data_offsets": [0, len(raw)]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + raw)


def _truth() -> dict[tuple[str, str], int]:
    """(run, run) -> elements that differ, by numpy."""
    names = sorted(RUNS)
    return {
        (x, y): int(np.count_nonzero(RUNS[x] != RUNS[y]))
        for i, x in enumerate(names)
        for y in names[i + 1 :]
    }


@pytest.fixture()
def study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "shared_study"
    root.mkdir()
    for name, w in RUNS.items():
        _write(root / f"{name}.safetensors", w)
    (root / "study.toml").write_text(
        'title = "t"\n[runs]\na = "a.safetensors"\nb = "b.safetensors"\nc = "c.safetensors"\n'
    )
    monkeypatch.setenv("DMLIB_CACHE_DIR", str(tmp_path / "user_cache"))
    report.configure(figure_dir=root / "figures", notebook="cache_test")
    yield root
    report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = stats_matrix.matrix_records

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stats_matrix, "matrix_records", counting)
    return seen


def _matrix(root: Path):
    st = report.load_study(root / "study.toml")
    files = {k: root / f"{k}.safetensors" for k in sorted(RUNS)}
    return st, files, cache.study_matrix(st, files, control=None)


def _n_diff(frame) -> dict[tuple[str, str], int]:
    return {(r.a, r.b): int(r.n_diff) for r in frame.itertuples()}


def _cache_file(st, files) -> Path:
    key = cache.matrix_key(st, files, {"control": None})
    return cache.cache_dir() / f"matrix-{key[:32]}.json"


def _forged_rows(st, files) -> dict:
    """An entry as an attacker would write it: dmlib's own layout, every pair identical."""
    frame = cache.study_matrix(st, files, control=None, use_cache=False)
    rows = json.loads(frame.drop(columns=[]).to_json(orient="records"))
    for r in rows:
        r.update(n_diff=0, max_abs=0.0, max_ulp=0, rel_fro=0.0, first_diff=None)
    verdict = frame.attrs["verdict"].to_dict()
    return {"rows": rows, "verdict": verdict, "attrs": {"runs": sorted(RUNS), "control": None}}


def test_the_oracle_pairs_differ() -> None:
    assert _truth() == {("a", "b"): 2, ("a", "c"): 0, ("b", "c"): 2}


def test_an_unsigned_cache_file_with_wrong_numbers_is_ignored(study, calls) -> None:
    st, files, _ = _matrix(study)  # a first run: dmlib's own entry exists
    path = _cache_file(st, files)
    forged = _forged_rows(st, files)
    key = cache.matrix_key(st, files, {"control": None})
    path.write_text(json.dumps({**forged, "format": "dmlib-matrix-cache-v1", "key": key}))
    before = len(calls)
    _, _, got = _matrix(study)
    assert len(calls) == before + 1  # recomputed, not read
    assert _n_diff(got) == _truth()


def test_a_cache_file_signed_with_another_secret_is_ignored(study, calls) -> None:
    st, files, _ = _matrix(study)
    path = _cache_file(st, files)
    key = cache.matrix_key(st, files, {"control": None})
    forged = {**_forged_rows(st, files), "format": cache.CACHE_FORMAT, "key": key}
    path.write_text(cache._signed(forged, key, b"k" * 32))  # the attacker's own key
    _, _, got = _matrix(study)
    assert _n_diff(got) == _truth()


def test_dmlibs_own_entry_with_its_numbers_altered_is_ignored(study, calls) -> None:
    st, files, first = _matrix(study)
    path = _cache_file(st, files)
    head, body = path.read_text().split("\n", 1)
    data = json.loads(body)
    for r in data["rows"]:
        r["n_diff"] = 0
    path.write_text(head + "\n" + json.dumps(data))  # dmlib's signature line kept
    n = len(calls)
    _, _, got = _matrix(study)
    assert len(calls) == n + 1 and _n_diff(got) == _truth()


def test_dmlibs_own_signed_entry_is_read_back(study, calls) -> None:
    _, _, first = _matrix(study)
    assert len(calls) == 1 and _n_diff(first) == _truth()
    _, _, second = _matrix(study)
    assert len(calls) == 1 and _n_diff(second) == _truth()  # read from the cache


def test_the_secret_is_private_and_outside_the_study(study, calls, tmp_path: Path) -> None:
    _matrix(study)
    key = tmp_path / "user_cache" / cache.KEY_FILE
    st = key.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 32
    assert not list(study.rglob(cache.KEY_FILE))


def test_a_secret_others_may_read_is_not_used(study, calls, tmp_path: Path) -> None:
    _matrix(study)
    key = tmp_path / "user_cache" / cache.KEY_FILE
    key.chmod(0o644)
    for _ in range(2):
        _, _, got = _matrix(study)
        assert _n_diff(got) == _truth()
    assert len(calls) == 3  # nothing trusted: computed every time


def test_a_secret_inside_the_study_signs_nothing(
    study, calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMLIB_CACHE_DIR", str(study / "dot_cache"))
    for _ in range(2):
        _matrix(study)
    assert len(calls) == 2
    assert not (study / "dot_cache").exists()
    assert not cache.cache_dir().exists() or not list(cache.cache_dir().glob("matrix-*"))


def test_cache_off_reads_and_writes_nothing(study, calls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DMLIB_CACHE_DIR", "off")
    _, _, got = _matrix(study)
    _matrix(study)
    assert len(calls) == 2 and _n_diff(got) == _truth()
    assert not cache.cache_dir().exists() or not list(cache.cache_dir().glob("matrix-*"))


def test_a_lock_file_that_is_a_link_is_not_followed(study, calls, tmp_path: Path) -> None:
    st = report.load_study(study / "study.toml")
    files = {k: study / f"{k}.safetensors" for k in sorted(RUNS)}
    path = _cache_file(st, files)
    path.parent.mkdir(parents=True)
    target = tmp_path / "elsewhere" / "created-by-dmlib"
    target.parent.mkdir()
    os.symlink(target, path.with_suffix(".lock"))
    _, _, got = _matrix(study)
    assert _n_diff(got) == _truth()
    assert not target.exists()
