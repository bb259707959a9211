"""Hostile mapping files: every pattern bounded in time, every transform in size.

A rule's source pattern is a regular expression built from a file someone else may have
written; its ``{x:*}`` captures backtrack for a time that grows as a power of the name's
length. Each match runs under the 1 s budget ``ignore_a`` has (``dmlib.names``); two
``{x:*}`` side by side are refused when the file is read; ``tie`` may not ask for more
copies than a checkpoint may hold tensors. Expected captures are worked out by hand.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dmlib import _limits, names
from dmlib.errors import DmlibError
from dmlib.mapping.resolve import resolve
from dmlib.mapping.spec import compile_pattern, loads

safetensors_numpy = pytest.importorskip("safetensors.numpy")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
CAPS = "abcdefghijkl"
# twelve {x:*} captures, a dot between each but a '!' before the last: against 60 dots
# (whose literal ends fit: the pattern starts and ends with a capture) every split is tried
SEPARATED = ".".join(f"{{{c}:*}}" for c in CAPS[:-1]) + "!{l:*}"
TARGET = "t." + ".".join(f"{{{c}}}" for c in CAPS)
DOTS = "." * 60


def _rule(source: str, target: str, extra: str = "") -> str:
    return f'version = 1\n[[rule]]\nsource = "{source}"\ntarget = "{target}"\n{extra}'


def test_a_backtracking_rule_is_stopped_by_the_budget() -> None:
    m = loads(_rule(SEPARATED, TARGET))
    t0 = time.monotonic()
    with pytest.raises(DmlibError, match=r"took more than 1 s on a name of 60 characters"):
        resolve(m, [DOTS], ["t"])
    assert time.monotonic() - t0 < 5
    # the timer is gone and the handler restored
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None, signal.default_int_handler)


def test_the_cli_refuses_the_backtracking_rule_exit_2(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors_numpy.save_file({DOTS: np.zeros(2, np.float32)}, str(a))
    safetensors_numpy.save_file({"t": np.zeros(2, np.float32)}, str(b))
    (tmp_path / "m.toml").write_text(_rule(SEPARATED, TARGET))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dmlib", "compare", str(a), str(b), "--map",
                        str(tmp_path / "m.toml")], capture_output=True, text=True, env=ENV,
                       timeout=60, check=False)  # fmt: skip
    assert r.returncode == 2 and time.monotonic() - t0 < 20
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "took more than 1 s" in err and "rule 1" in err


def test_two_any_captures_side_by_side_are_refused_on_reading() -> None:
    with pytest.raises(DmlibError, match=r"rule 1: pattern .*two \{x:\*\} captures side by side"):
        loads(_rule("".join(f"{{{c}:*}}" for c in CAPS) + "!", TARGET))
    # a digit capture beside an any capture is no ambiguity of two unbounded parts
    loads(_rule("{a:*}{i}.w", "{a}.{i}"))


def test_too_many_captures_are_refused() -> None:
    src = ".".join(f"{{c{i}}}" for i in range(20))
    with pytest.raises(DmlibError, match="20 captures, more than the 16"):
        loads(_rule(src, "t." + src))


def test_patterns_still_match_what_they_say() -> None:
    """Captures as worked out by hand, through the budgeted matcher."""
    m = loads(_rule("{p:*}.layers.{i}.{w:w}", "model.{p}.h.{i}.{w}"))
    a = ["enc.x.layers.3.weight", "enc.layers.12.bias"]
    b = ["model.enc.x.h.3.weight", "model.enc.h.12.bias"]
    res = resolve(m, a, b)
    got = sorted((bd.sources, bd.targets, bd.captures) for bd in res.bindings)
    assert got == [
        (("enc.layers.12.bias",), ("model.enc.h.12.bias",),
         (("i", "12"), ("p", "enc"), ("w", "bias"))),
        (("enc.x.layers.3.weight",), ("model.enc.x.h.3.weight",),
         (("i", "3"), ("p", "enc.x"), ("w", "weight"))),
    ]  # fmt: skip


def test_a_number_of_thousands_of_digits_is_not_captured() -> None:
    """``{i}`` takes at most 18 digits: a gathered shard number of 5,000 digits reached
    int(), which refuses more than 4,300 (a ValueError: exit 4)."""
    m = loads(_rule("r{k}.w", "w", 'transforms = [{ op = "concat", axis = 0 }]\n'))
    with pytest.raises(DmlibError, match="matches no tensor of A"):
        resolve(m, ["r" + "7" * 5000 + ".w"], ["w"])
    bindings = resolve(m, ["r0.w", "r1.w"], ["w"]).bindings
    assert [(b.sources, b.targets) for b in bindings] == [(("r0.w", "r1.w"), ("w",))]


def test_compiled_patterns_are_kept() -> None:
    assert compile_pattern("x.{i}.y") is compile_pattern("x.{i}.y")


def test_outside_the_main_thread_matching_is_untimed_but_works() -> None:
    m = loads(_rule("{p:*}.w", "{p}.v"))
    out: list = []
    t = threading.Thread(target=lambda: out.append(resolve(m, ["a.b.w"], ["a.b.v"])))
    t.start()
    t.join(30)
    assert [b.targets for b in out[0].bindings] == [("a.b.v",)]


def test_the_budget_interrupts_only_a_match_past_it() -> None:
    """Slow work between matches in the block is not refused (the timer checks the match)."""
    import re

    rx = re.compile("a+b")
    with names.regex_budget("test") as budget:
        time.sleep(1.6)  # the timer ticks every 0.25 s meanwhile
        assert budget.fullmatch(rx, "aab") is not None
        assert budget.fullmatch(rx, "aac") is None


def test_tie_with_a_billion_copies_is_refused_before_any_copy(tmp_path: Path) -> None:
    tie = 'transforms = [{ op = "tie", copies = 1000000000 }]\n'
    with pytest.raises(DmlibError, match=r"tie.copies is 1,000,000,000, more than the"):
        loads(_rule("w", "w", tie))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for p in (a, b):
        safetensors_numpy.save_file({"w": np.zeros(2, np.float32)}, str(p))
    (tmp_path / "m.toml").write_text(_rule("w", "w", tie))
    r = subprocess.run([sys.executable, "-m", "dmlib", "compare", str(a), str(b), "--map",
                        str(tmp_path / "m.toml")], capture_output=True, text=True, env=ENV,
                       timeout=60, check=False)  # fmt: skip
    assert r.returncode == 2 and "tie.copies" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_tie_up_to_the_limit_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_limits, "max_entries", lambda: 4)
    loads(_rule("w", "w", 'transforms = [{ op = "tie", copies = 4 }]\n'))
    with pytest.raises(DmlibError, match="tie.copies is 5"):
        loads(_rule("w", "w", 'transforms = [{ op = "tie", copies = 5 }]\n'))


def test_a_fifo_or_device_mapping_file_is_refused_without_waiting(tmp_path: Path) -> None:
    from dmlib.mapping.spec import load_mapping

    fifo = tmp_path / "m.toml"
    os.mkfifo(fifo)
    with pytest.raises(DmlibError, match="not a regular file"):
        load_mapping(fifo)
    zero = tmp_path / "zero.toml"
    os.symlink("/dev/zero", zero)
    with pytest.raises(DmlibError, match="not a regular file"):
        load_mapping(zero)


def test_a_mapping_file_over_the_size_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.mapping.spec import load_mapping

    p = tmp_path / "m.toml"
    p.write_text(_rule("w", "w") + "# " + "x" * 5000 + "\n")
    assert load_mapping(p).rules[0].sources == ("w",)
    monkeypatch.setattr(_limits, "MAX_TEXT_BYTES", 4096)
    with pytest.raises(DmlibError, match="more than the 4.0 KiB a mapping file may take"):
        load_mapping(p)
