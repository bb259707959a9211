"""SIGINT and SIGTERM while ``dmlib report`` runs its notebooks' kernels: one line, exit 130
or 143, no traceback (nbclient's exit hooks printed one per notebook), no kernel left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "data" / "qr_init" / "study.toml"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see kernels"),
]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _kernels(pid: int) -> list[int]:
    found = []
    for c in _children(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ipykernel" in cmd:
            found.append(c)
    return found


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a suite started with SIGINT ignored


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated"),
                                           (signal.SIGINT, 130, "interrupted")])  # fmt: skip
@pytest.mark.parametrize("attempt", range(3))
def test_signal_during_report(tmp_path, sig, code, word, attempt):
    pytest.importorskip("nbclient")
    cmd = [sys.executable, "-m", "dmlib", "report", str(STUDY), "--out", str(tmp_path / "r")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                         preexec_fn=_default_sigint)  # fmt: skip
    t0 = time.monotonic()
    kernels: list[int] = []
    while p.poll() is None and not kernels and time.monotonic() - t0 < 120:
        kernels = _kernels(p.pid)
        time.sleep(0.05)
    assert kernels and p.poll() is None, "the report ended before a kernel started"
    time.sleep(1.0 + 1.5 * attempt)  # the kernel started, its cells running
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    text = err.decode()
    assert p.returncode == code, text
    assert "Traceback" not in text and "Exception ignored" not in text, text
    assert text.strip().splitlines()[-1] == f"dmlib report: {word}"
    assert not (tmp_path / "r").exists()  # nothing half-written
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{k}").exists() for k in kernels) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [k for k in kernels if Path(f"/proc/{k}").exists()
            and "Z" not in Path(f"/proc/{k}/stat").read_text().rpartition(")")[2].split()[:1]]  # fmt: skip
    assert not left, f"kernels left running: {left}"
