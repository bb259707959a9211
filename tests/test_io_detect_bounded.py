"""Format detection of a folder does bounded work, whatever the folder holds.

The oracle is a count, not a time: ``os.stat`` and ``os.lstat`` (what ``os.path.isdir``,
``isfile``, ``exists`` and ``lexists`` call) are wrapped, and so are ``os.scandir`` and
``os.listdir`` (the entries they hand back are counted). A folder of 20,000 entries must
cost detection the same number of stats as a folder of 64 entries of the same kind, and
the Orbax and save_pretrained sniffs must read far fewer than its 20,000 entries. Before
detection was bounded the Orbax sniff stat'ed every subfolder two or three times (about
60,000 stats for 20,000 subfolders).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import dmlib.io
from dmlib.errors import FormatError
from dmlib.io import hf_pretrained, orbax

# making and removing the folders' 150,000 entries takes 10-25 s on a loaded machine
pytestmark = pytest.mark.slow

BIG = 20_000
SMALL = 64

# how each kind of folder is filled: entry i's name, and whether it is a folder
_KINDS: dict[str, tuple[Callable[[int], str], bool]] = {
    "plain_dirs": (lambda i: f"d{i}", True),
    "numbered_dirs": (lambda i: str(i), True),  # what an Orbax manager's step folders look like
    "checkpoint_dirs": (lambda i: f"checkpoint-{i}", True),
    "plain_files": (lambda i: f"f{i}", False),
}


def _fill(folder: Path, kind: str, n: int) -> Path:
    name, is_dir = _KINDS[kind]
    folder.mkdir()
    for i in range(n):
        p = os.path.join(folder, name(i))
        if is_dir:
            os.mkdir(p)
        else:
            open(p, "wb").close()
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    root = tmp_path_factory.mktemp("bounded")
    sizes = {k: (BIG,) if k == "checkpoint_dirs" else (SMALL, BIG) for k in _KINDS}
    return {(k, n): _fill(root / f"{k}_{n}", k, n) for k in _KINDS for n in sizes[k]}


class _Counts:
    def __init__(self) -> None:
        self.stats = 0
        self.entries = 0


@contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counts]:
    counts = _Counts()
    real_stat, real_lstat, real_scandir, real_listdir = os.stat, os.lstat, os.scandir, os.listdir

    def stat(*args: Any, **kwargs: Any) -> Any:
        counts.stats += 1
        return real_stat(*args, **kwargs)

    def lstat(*args: Any, **kwargs: Any) -> Any:
        counts.stats += 1
        return real_lstat(*args, **kwargs)

    class _Scan:  # os.scandir's iterator, counting what it hands back
        def __init__(self, *args: Any) -> None:
            self._it = real_scandir(*args)

        def __enter__(self) -> _Scan:
            return self

        def __exit__(self, *exc: object) -> None:
            self._it.close()

        def __iter__(self) -> _Scan:
            return self

        def __next__(self) -> os.DirEntry[str]:
            entry = next(self._it)
            counts.entries += 1
            return entry

        def close(self) -> None:
            self._it.close()

    def listdir(*args: Any) -> list[str]:
        names = real_listdir(*args)
        counts.entries += len(names)
        return names

    with monkeypatch.context() as m:
        m.setattr(os, "stat", stat)
        m.setattr(os, "lstat", lstat)
        m.setattr(os, "scandir", _Scan)
        m.setattr(os, "listdir", listdir)
        yield counts


def _detection_stats(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """The stats ``detect_format`` makes on ``path`` (no folder format takes these)."""
    with _counting(monkeypatch) as counts, pytest.raises(FormatError):
        dmlib.io.detect_format(path)
    return counts.stats


@pytest.mark.parametrize("kind", ["numbered_dirs", "plain_dirs", "plain_files"])
def test_detection_stats_do_not_grow_with_the_folder(
    kind: str, folders: dict[tuple[str, int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _detection_stats(folders[kind, SMALL], monkeypatch)  # imports the readers: not counted next
    small = _detection_stats(folders[kind, SMALL], monkeypatch)
    big = _detection_stats(folders[kind, BIG], monkeypatch)
    assert big == small, (kind, small, big)
    assert big < 200, (kind, big)


def test_a_run_folder_of_too_many_checkpoints_is_refused_in_few_stats(
    folders: dict[tuple[str, int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a run folder under the limit is looked into once per checkpoint-N folder: that work
    # grows with the folder up to the Trainer reader's MAX_CHECKPOINTS)
    big = folders["checkpoint_dirs", BIG]
    with _counting(monkeypatch) as counts, pytest.raises(FormatError, match="20,000 checkpoint-N"):
        dmlib.io.detect_format(big)
    assert counts.stats < 200, counts.stats


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_folder_sniffs_read_few_entries(
    kind: str, folders: dict[tuple[str, int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    big = str(folders[kind, BIG])
    with _counting(monkeypatch) as counts:
        assert orbax.checkpoint_folder(big) is None
        assert not hf_pretrained.can_open_model(big)
        assert not hf_pretrained.can_open_adapter(big)
        assert hf_pretrained.near_miss(big) is None
    # the Orbax sniff reads the folder's first entries at most twice (an item, then a step)
    assert counts.entries <= 2 * (orbax.SNIFF_ENTRIES + 1) < BIG // 4, counts.entries
    assert counts.stats < 200, counts.stats


def test_marked_folders_among_many_entries_are_still_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _fill(tmp_path / "marked", "plain_files", BIG)
    marks = {"hf-model": ("config.json", "model.safetensors"), "orbax": ("_CHECKPOINT_METADATA",)}
    for expected, names in marks.items():  # Orbax's sniff runs first: marked last
        for name in names:
            (folder / name).write_bytes(b"{}")
        dmlib.io.detect_format(folder)  # readers imported outside the count
        with _counting(monkeypatch) as counts:
            assert dmlib.io.detect_format(folder) == expected
        assert counts.stats < 200, (expected, counts.stats)
