"""The format registry (dmlib.io.REGISTRY) is consistent with its reader modules."""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

import dmlib
import dmlib.io
from dmlib.errors import UnknownFormatError
from dmlib.io import FORMATS, REGISTRY, format_for_suffix, format_info, is_folder_checkpoint


@pytest.mark.parametrize("row", REGISTRY, ids=lambda r: r.name)
def test_every_row_names_functions_its_module_has(row):
    module = importlib.import_module(f"dmlib.io.{row.module}")
    named = [row.opener, row.sniff, row.folder_sniff, row.locate]
    for function in filter(None, named):
        assert callable(getattr(module, function, None)), f"{row.module}.{function}"
    opener = inspect.signature(getattr(module, row.opener))
    assert set(row.options) <= set(opener.parameters)
    # a file format is recognised by its content, a folder format by its folder
    assert (row.sniff is None) == row.folder
    assert (row.folder_sniff is not None) == row.folder
    assert row.description and row.name


def test_names_and_suffixes_are_unique_and_formats_lists_the_rows():
    assert FORMATS == tuple(r.name for r in REGISTRY)
    assert len(set(FORMATS)) == len(FORMATS)
    suffixes = [s for r in REGISTRY for s in r.suffixes]
    assert len(set(suffixes)) == len(suffixes)
    assert all(s.startswith(".") and s == s.lower() for s in suffixes)
    # within one kind of sniff, the order is total
    for folder in (False, True):
        ranks = [r.rank for r in REGISTRY if r.folder == folder]
        assert len(set(ranks)) == len(ranks)


def test_orbax_row_lists_the_files_the_reader_takes_for_its_folder():
    from dmlib.io import orbax

    (row,) = [r for r in REGISTRY if r.name == "orbax"]
    assert row.folder_files == orbax.FOLDER_FILES


def test_public_lookups(tmp_path):
    assert format_for_suffix("a/b/Model.SafeTensors") == "safetensors"
    assert format_for_suffix("x.pth") == "torch"
    assert format_for_suffix("x.txt") is None
    assert format_info("gguf").module == "gguf"
    with pytest.raises(UnknownFormatError, match="unknown format 'h5'"):
        format_info("h5")
    f = tmp_path / "x.npy"
    np.save(f, np.zeros(3))
    assert not is_folder_checkpoint(f) and not is_folder_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"x")  # a DCP folder by its layout
    assert is_folder_checkpoint(tmp_path) and dmlib.io.detect_format(tmp_path) == "dcp"


def test_format_given_for_what_the_path_is_not(tmp_path):
    # the messages of the checks each row's opener runs behind (as before the registry)
    from dmlib.errors import FormatError

    f = tmp_path / "w.safetensors"
    dmlib.write_safetensors(f, {"w": np.zeros(2, np.float32)})
    with pytest.raises(
        FormatError, match="record= applies to burnpack files only, not safetensors"
    ):
        dmlib.io.open_tensors(f, record=0)
    with pytest.raises(FormatError, match="format hf-trainer names a folder, not a file"):
        dmlib.io.open_tensors(f, format="hf-trainer")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        FormatError, match=r"not a DCP checkpoint directory \(no \.metadata in it\)"
    ):
        dmlib.io.open_tensors(empty, format="dcp")
    with pytest.raises(FormatError, match="not an Orbax checkpoint folder"):
        dmlib.io.open_tensors(empty, format="orbax")
    with pytest.raises(UnknownFormatError, match="unknown format 'h5'; expected one of burnpack"):
        dmlib.io.open_tensors(f, format="h5")
