"""A checkpoint folder's JSON files are parsed within one set of bounds, by one helper
(``io._folderfiles.json_member``), for each of its callers: the Trainer state
(``io.hf_trainer``), a ``save_pretrained`` folder's config (``io.hf_pretrained``) and the
config read to name a Trainer folder's optimizer moments (``io._hf_names._architecture``,
which says it could not read the file rather than failing the comparison).

Each bound is checked at its value and one past it: an object of ``MAX_JSON_KEYS`` keys is
read and one of one more key refused; a document nested ``MAX_NESTING`` levels (counted as
``_limits.nesting_depth`` counts: each object and list one level) is read and one nested a
level deeper refused, as is one nested far past Python's recursion limit. The documents
are built here with a known depth and key count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dmlib import _limits
from dmlib.errors import FormatError
from dmlib.io import _hf_names, hf_pretrained, hf_trainer

NOT_READ = "there is no readable config.json naming the architecture"

# caller -> (the file it reads, the rest of a document it reads)
CALLERS: dict[str, tuple[str, dict[str, Any]]] = {
    "trainer_state": ("trainer_state.json", {"global_step": 1}),
    "config": ("config.json", {"model_type": "llama"}),
    # a layer count above the parameters given: read to the end, never built
    "architecture": (
        "config.json",
        {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1000},
    ),
}


def _outcome(caller: str, folder: Path) -> str | None:
    """None where the caller read the file; the refusal's text where it did not."""
    if caller == "architecture":
        order, why = _hf_names._architecture(str(folder), 10)
        assert order is None
        if why == NOT_READ:
            return why
        # parsed, and the layer count seen: only a file that was read gets this far
        assert why.startswith("config.json declares 1,000 layers, more than the 10"), why
        return None
    try:
        if caller == "trainer_state":
            hf_trainer._trainer_state(str(folder))
        else:
            hf_pretrained._config(str(folder), "config.json")
    except FormatError as err:
        return str(err)
    return None


def _folder(tmp_path: Path, caller: str, text: str) -> Path:
    d = tmp_path / caller
    d.mkdir(parents=True)
    (d / CALLERS[caller][0]).write_text(text, encoding="utf-8")
    return d


def _nested(levels: int) -> str:
    """A list ``levels`` deep (``[[...]]``: nesting_depth == levels), as JSON text."""
    return "[" * levels + "]" * levels


def _with_pad(caller: str, pad: str) -> str:
    base = json.dumps(CALLERS[caller][1])
    return base[:-1] + f', "pad": {pad}}}'


def _refused_naming(caller: str, tmp_path: Path, got: str | None, *words: str) -> None:
    assert got is not None
    if caller == "architecture":
        assert got == NOT_READ
        return
    fpath = tmp_path / caller / CALLERS[caller][0]
    assert got.startswith(f"{fpath}: ") and "\n" not in got, got
    for w in words:
        assert w in got, got


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_an_object_at_the_key_bound_is_read_one_more_key_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caller: str
) -> None:
    monkeypatch.setattr(_limits, "MAX_JSON_KEYS", 5)
    at = json.dumps({f"k{i}": i for i in range(5)})
    assert _outcome(caller, _folder(tmp_path / "at", caller, _with_pad(caller, at))) is None
    over = json.dumps({f"k{i}": i for i in range(6)})
    got = _outcome(caller, _folder(tmp_path, caller, _with_pad(caller, over)))
    _refused_naming(caller, tmp_path, got, "an object of 6 keys, more than the 5")


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_nesting_at_the_bound_is_read_one_level_deeper_refused(tmp_path: Path, caller: str) -> None:
    top = _limits.MAX_NESTING
    # the top object is one level: its "pad" holds the rest
    at = _with_pad(caller, _nested(top - 1))
    assert _limits.nesting_depth(json.loads(at)) == top
    assert _outcome(caller, _folder(tmp_path / "at", caller, at)) is None
    over = _with_pad(caller, _nested(top))
    got = _outcome(caller, _folder(tmp_path, caller, over))
    _refused_naming(caller, tmp_path, got, f"nests too deeply (more than {top} levels)")


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_nesting_past_the_parsers_recursion_is_refused(tmp_path: Path, caller: str) -> None:
    deep = _with_pad(caller, _nested(100_000))
    got = _outcome(caller, _folder(tmp_path, caller, deep))
    _refused_naming(caller, tmp_path, got, "nests too deeply (more than 64 levels)")


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_corrupt_json_is_refused_naming_the_file(tmp_path: Path, caller: str) -> None:
    for i, text in enumerate(('{"a": ', "\udcff")):
        where = tmp_path / str(i)
        where.mkdir()
        d = where / caller
        d.mkdir()
        raw = text.encode("utf-8", "surrogateescape")  # the second: a byte that is not UTF-8
        (d / CALLERS[caller][0]).write_bytes(raw)
        _refused_naming(caller, where, _outcome(caller, d), "corrupt")


@pytest.mark.parametrize("text", ["null", "[1, 2]", "3"])
def test_a_trainer_state_that_is_not_an_object_is_refused_as_such(
    tmp_path: Path, text: str
) -> None:
    """``null`` was told as nested too deeply; any value but an object is refused as what it is."""
    got = _outcome("trainer_state", _folder(tmp_path, "trainer_state", text))
    _refused_naming("trainer_state", tmp_path, got, "is a JSON", "not an object")
