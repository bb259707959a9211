"""Run a command as a child and measure it honestly: seconds from fork to exit, peak RSS."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

# Linux keeps a process's peak RSS across fork and exec (the exec'ing image's high-water
# mark is folded into the new program's ru_maxrss), so a child forked from this process,
# which generated the files, would report this process's peak. A small launcher (python -S,
# a few MiB) forks the command instead and reports its time and peak from wait4.
_LAUNCH = """
import os, sys, time
out, cmd = sys.argv[1], sys.argv[2:]
t = time.perf_counter()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.execvp(cmd[0], cmd)
_, status, usage = os.wait4(pid, 0)
dt = time.perf_counter() - t
with open(out, "w") as f:
    cpu = usage.ru_utime + usage.ru_stime
    f.write(f"{dt} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)} {cpu}")
"""


def run(
    cmd: list[str], ok: tuple[int, ...] = (0, 1), cwd: str | Path | None = None
) -> tuple[float, float]:
    """(seconds from fork to exit, peak RSS MiB) of one command, through the launcher."""
    dt, rss, _ = run_cpu(cmd, ok, cwd)
    return dt, rss


def run_cpu(
    cmd: list[str], ok: tuple[int, ...] = (0, 1), cwd: str | Path | None = None
) -> tuple[float, float, float]:
    """(seconds from fork to exit, peak RSS MiB, CPU seconds user + system) of one command.

    On a machine shared with other jobs the wall time depends on how much of the CPUs the
    command got; the CPU seconds it used do not (much), so both are reported.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "launch.txt"
        proc = subprocess.run(
            [sys.executable, "-S", "-c", _LAUNCH, str(out), *cmd],
            cwd=cwd,
            stderr=subprocess.PIPE,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"launcher failed: {proc.stderr.decode()[-500:]}")
        dt, rss_kib, code, cpu = out.read_text().split()
    if int(code) not in ok:
        raise SystemExit(f"{' '.join(cmd)} exited {code}: {proc.stderr.decode().strip()[-500:]}")
    return float(dt), int(rss_kib) / 1024, float(cpu)
