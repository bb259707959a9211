"""Promise: bad input exits 2, an interruption 130 with one line, user regexes are bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dmlib.errors import DmlibError
from dmlib.names import user_regex

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _many(path: Path, n: int, shift: float) -> None:
    from safetensors.numpy import save_file

    a = np.random.default_rng(0).standard_normal((n, 8), dtype=np.float32)
    a[:, 0] += shift
    save_file({f"layer{i}.w": a[i] for i in range(n)}, str(path))


def _mapped(pid: int, name: str) -> bool:
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt. A suite started in the background by a shell without job control
    inherits SIGINT ignored, and an ignored SIGINT would never reach the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see the run")
@pytest.mark.parametrize(
    "sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_interrupted_compare_exits_130_with_one_line(
    tmp_path: Path, sig: int, code: int, word: str
) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _many(a, 8000, 0.0)
    _many(b, 8000, 1e-3)
    p = subprocess.Popen([sys.executable, "-m", "dmlib", "compare", str(a), str(b)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                         preexec_fn=default_sigint)  # fmt: skip
    t0 = time.monotonic()
    while p.poll() is None and not _mapped(p.pid, "b.safetensors") and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    assert p.poll() is None, "compare ended before it could be interrupted"
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code
    assert b"Traceback" not in err
    assert err.decode().strip().splitlines() == [f"dmlib compare: {word}"]


def test_bad_input_exits_2_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\xff" * 64)
    r = subprocess.run([sys.executable, "-m", "dmlib", "inspect", str(bad)],
                       capture_output=True, env=ENV)  # fmt: skip
    assert r.returncode == 2
    assert len(r.stderr.decode().strip().splitlines()) == 1
    assert b"Traceback" not in r.stderr


def test_nested_quantifier_regex_is_refused() -> None:
    for pattern in [r"(a+)+$", r"(ab|a)*c", r"(.*,)*z"]:
        with pytest.raises(DmlibError, match="repeats a repetition"):
            user_regex(pattern, "test")
    assert user_regex(r"layers\.\d+\.attn", "test")("enc.layers.3.attn.q")


def test_polynomial_regex_is_stopped_by_its_budget() -> None:
    import re

    search = user_regex(r".*a.*b.*c", "test")
    name = "ab" * 1500
    t0 = time.monotonic()
    with pytest.raises(DmlibError, match="took more than"):
        search(name)
    assert time.monotonic() - t0 < 5
    assert search("xaybzc") is (re.search(r".*a.*b.*c", "xaybzc") is not None)


def test_include_regex_through_the_cli_cannot_hang(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    a = tmp_path / "a.safetensors"
    save_file({"ab" * 1500: np.zeros(1, np.float32)}, str(a))
    r = subprocess.run([sys.executable, "-m", "dmlib", "compare", str(a), str(a),
                        "--include", "re:.*a.*b.*c"], capture_output=True, env=ENV, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert b"took more than" in r.stderr
