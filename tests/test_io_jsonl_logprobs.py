"""The JSONL log-prob reader (dmlib.io.jsonl_logprobs): arrays equal to what json and numpy
make of each line by themselves, and every bound refused naming the file and the line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dmlib import _limits
from dmlib.errors import DmlibError, FormatError
from dmlib.io import jsonl_logprobs as J
from dmlib.stats.logprobs import compare_logprobs


def write(p: Path, *objs: object) -> Path:
    p.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return p


def test_lines_read_as_json_and_numpy_read_them(tmp_path: Path) -> None:
    lines = [
        {"logprobs": [-0.5, -1.25, -3.0], "tokens": [7, 8, 9], "mask": [1, 0, 1]},
        {"logprobs": [], "tokens": []},
        {
            "logprobs": [-2.0],
            "top_logprobs": [[-0.1, -2.5]],
            "top_ids": [[4, 1]],
            "positions": [3],
        },
    ]
    p = write(tmp_path / "x.JSONL", {"metadata": {"model": "m", "temperature": 0.7}}, *lines)
    with open(p, "a") as f:
        f.write("\n   \n")  # blank lines are skipped
    assert J.is_jsonl(p) and J.is_jsonl("a/b.ndjson") and not J.is_jsonl("x.json")
    ts = J.read_jsonl(p)
    assert ts.metadata == {"model": "m", "temperature": "0.7"}
    # the oracle: json.loads and np.asarray of each line, on their own
    want = {}
    for n, line in enumerate(json.loads(x) for x in p.read_text().splitlines()[1:4]):
        for key, value in line.items():
            want[f"{key}.{n}"] = np.asarray(value)
    assert sorted(ts) == sorted(want)
    for name, arr in want.items():
        got = ts[name].load()
        kind = "f" if name.startswith(("logprobs", "top_logprobs")) else "i"
        assert got.dtype == (np.float64 if kind == "f" else np.int64), name
        assert got.shape == arr.shape and np.array_equal(got, arr), name


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 1: not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"tokens": [1]}', "no 'logprobs' list"),
        ('{"logprobs": [-1.0], "tokens": [1.5]}', "'tokens' must hold integers"),
        ('{"logprobs": ["x"]}', "'logprobs' must hold numbers"),
        ('{"logprobs": [-1.0], "top_ids": [[1, 2], [3]]}', "lists of integers, all of one length"),
        ('{"logprobs": [-1.0], "other": 1}', "unknown key"),
        ('{"metadata": {"a": [1]}}', "'metadata' must map names to plain values"),
        # nested one level past what a line holds: refused, not read as 3-D
        ('{"logprobs": [-1.0], "top_ids": [[[1]]]}', "'top_ids' must hold lists of integers"),
        ('{"logprobs": ' + "[" * 70 + "1" + "]" * 70 + "}", "'logprobs' must hold numbers"),
        # past the parser's recursion: one line, not a crash
        ('{"logprobs": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_bad_lines_are_refused_naming_file_and_line(
    tmp_path: Path, line: str, message: str
) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(FormatError, match=message) as info:
        J.read_jsonl(p)
    assert str(p) in str(info.value)
    with pytest.raises(DmlibError, match=message):  # the same through the comparison
        compare_logprobs(p, p)


def test_an_object_with_too_many_keys_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_limits, "MAX_JSON_KEYS", 3)
    p = write(tmp_path / "x.jsonl", {"metadata": {"a": 1, "b": 2, "c": 3, "d": 4}})
    with pytest.raises(FormatError, match="line 1: an object of 4 keys"):
        J.read_jsonl(p)
    write(p, {"metadata": {"a": 1, "b": 2, "c": 3}}, {"logprobs": [-1.0]})
    assert J.read_jsonl(p).metadata == {"a": "1", "b": "2", "c": "3"}


def test_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path / "x.jsonl", *({"logprobs": [-1.0, -2.0, -3.0]} for _ in range(3)))
    monkeypatch.setattr(J, "JSONL_MAX_LINES", 2)
    with pytest.raises(FormatError, match="more than 2 sequences"):
        J.read_jsonl(p)
    monkeypatch.setattr(J, "JSONL_MAX_LINES", 10)
    monkeypatch.setattr(J, "JSONL_MAX_TOKENS", 2)
    with pytest.raises(FormatError, match="at most 2 entries"):
        J.read_jsonl(p)
    monkeypatch.setattr(J, "JSONL_MAX_TOKENS", 10)
    line = len(json.dumps({"logprobs": [-1.0, -2.0, -3.0]})) + 1  # its newline counted
    monkeypatch.setattr(J, "JSONL_MAX_LINE_BYTES", line - 1)
    with pytest.raises(FormatError, match="line 1 is longer than"):
        J.read_jsonl(p)
    monkeypatch.setattr(J, "JSONL_MAX_LINE_BYTES", line)  # exactly the bound: read
    assert len(J.read_jsonl(p)) == 3
    p.write_text(p.read_text().rstrip("\n"))  # the last line without its newline
    assert len(J.read_jsonl(p)) == 3
    q = tmp_path / "one.jsonl"
    q.write_text(json.dumps({"logprobs": [-1.0, -2.0, -3.0]}))  # line - 1 bytes, no newline
    monkeypatch.setattr(J, "JSONL_MAX_LINE_BYTES", line - 1)
    assert len(J.read_jsonl(q)) == 1
    monkeypatch.setattr(J, "JSONL_MAX_LINE_BYTES", line - 2)
    with pytest.raises(FormatError, match="line 1 is longer than"):
        J.read_jsonl(q)
    monkeypatch.setattr(J, "jsonl_max_bytes", lambda: 10)
    with pytest.raises(FormatError, match="over the 10 bytes read"):
        J.read_jsonl(p)


def test_empty_file_missing_file_and_fifo(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    p.write_text("\n\n")
    with pytest.raises(FormatError, match="no sequence in the file"):
        J.read_jsonl(p)
    with pytest.raises(FormatError, match="cannot read"):
        J.read_jsonl(tmp_path / "missing.jsonl")
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)  # refused without waiting for a writer
    with pytest.raises(FormatError, match="not a regular file"):
        J.read_jsonl(fifo)
    with pytest.raises(DmlibError, match="not a regular file"):
        compare_logprobs(fifo, fifo)
