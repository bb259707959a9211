"""Mapping files, generated and mutated: read and resolved, or refused with a DmlibError,
never another exception or a hang (every pattern runs under the regex budget).

When a generated mapping of plain renames resolves, each binding is checked against the
renames it was built from (worked out here, not by dmlib).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import fuzzlib
from _support.fuzzlib import no_hang
from hypothesis import given
from hypothesis import strategies as st

from dmlib.errors import DmlibError
from dmlib.mapping.resolve import resolve
from dmlib.mapping.spec import load_mapping

_PIECE = st.sampled_from(
    ["a", "b", ".", "layers", "w", "0", "12", "{i}", "{j}", "{p:w}", "{x:*}", "{y:*}", "{",
     "}", "{i:q}", ":", "*", "\\", '"', "\x1b", "é", "{x:*}{y:*}"]
)  # fmt: skip
_PATTERN = st.lists(_PIECE, min_size=1, max_size=8).map("".join)
_OP = st.fixed_dictionaries(
    {"op": st.sampled_from(["transpose", "permute", "reshape", "split", "concat", "rotary",
                            "cast", "tie", "nope"])},
    optional={
        "axis": st.integers(-70, 5), "axes": st.lists(st.integers(-2, 3), max_size=3),
        "parts": st.integers(-1, 4), "copies": st.integers(-1, 10**12),
        "shape": st.lists(st.integers(-1, 6), max_size=3), "to": st.sampled_from(["hf", "x"]),
        "heads": st.integers(0, 4), "dtype": st.sampled_from(["float16", "nope", "bfloat16"]),
        "sizes": st.lists(st.integers(-1, 4), max_size=3), "pieces": st.lists(st.integers(-1, 3)),
    },
)  # fmt: skip
_NAMES = st.lists(
    st.lists(st.sampled_from(["a", "b", "layers", "w", "0", "12", "x", "."]), max_size=8).map(
        "".join
    ),
    max_size=10,
    unique=True,
)


def _toml(rules: list[dict], extra: str = "") -> str:
    out = ["version = 1", extra]
    for r in rules:
        out.append("[[rule]]")
        for k, v in r.items():
            out.append(f"{k} = {_value(v)}")
    return "\n".join(out) + "\n"


def _value(v: object) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)  # a TOML basic string is a JSON string


def _load_and_resolve(path: Path, names_a: list[str], names_b: list[str], target: str) -> object:
    try:
        with no_hang():
            m = load_mapping(path)
            res = resolve(m, names_a, names_b)
    except DmlibError as err:
        assert "\n" not in str(err), str(err)
        fuzzlib.COUNTS[target]["refused"] += 1
        return None
    fuzzlib.COUNTS[target]["read"] += 1
    return res


@fuzzlib.fuzz()
@given(
    rules=st.lists(
        st.fixed_dictionaries(
            {"source": _PATTERN | st.lists(_PATTERN, max_size=3), "target": _PATTERN},
            optional={"transforms": st.lists(_OP, max_size=3), "tied": st.booleans()},
        ),
        max_size=4,
    ),
    names_a=_NAMES,
    names_b=_NAMES,
    same=st.booleans(),
)
def test_mapping_generated(
    tmp_path_factory: pytest.TempPathFactory, rules, names_a, names_b, same
) -> None:
    path = tmp_path_factory.mktemp("map") / "m.toml"
    path.write_text(_toml(rules, "same_names = true" if same else ""), encoding="utf-8")
    _load_and_resolve(path, names_a, names_b, "mapping generated")


@fuzzlib.fuzz()
@given(
    renames=st.dictionaries(
        st.sampled_from(["a.w", "b.w", "layers.0.w", "layers.12.w", "x"]),
        st.sampled_from(["A", "B", "L0", "L12", "X"]),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
)
def test_mapping_renames_resolve_as_written(
    tmp_path_factory: pytest.TempPathFactory, renames, data
) -> None:
    """Plain renames (no capture), one rule each: each binding is the rename it came from."""
    rules = [{"source": s, "target": t} for s, t in renames.items()]
    path = tmp_path_factory.mktemp("ren") / "m.toml"
    text = bytearray(_toml(rules).encode())
    if data.draw(st.booleans(), label="mutate"):
        pos = data.draw(st.integers(0, len(text) - 1), label="pos")
        text[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path.write_bytes(bytes(text))
    a, b = list(renames), list(renames.values())
    res = _load_and_resolve(path, a, b, "mapping renames")
    if res is None:
        return
    got = {bd.sources: bd.targets for bd in res.bindings}  # type: ignore[attr-defined]
    if bytes(text) == _toml(rules).encode():
        assert got == {(s,): (t,) for s, t in renames.items()}
    else:  # a mutated file that still resolves: every binding one of A's names onto B's
        assert all(set(s) <= set(a) and set(t) <= set(b) for s, t in got.items())
