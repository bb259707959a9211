"""Run one data-generating worker as its own operating-system process.

The lab's datasets are about what differs *between processes*; a worker run in the
parent's interpreter would share its per-process state (reduction strategy, thread
pool, instruction-set dispatch, parameter ids) and measure nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError

# the directory that holds the ``dmlib`` package, so ``python -m dmlib...`` resolves to
# this checkout whatever the working directory of the worker is
_ROOT = str(Path(__file__).resolve().parents[2])


def run_worker(
    module: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run ``python -m module --worker *args`` and return the JSON its last stdout line holds.

    Parameters
    ----------
    module
        Dotted module name with a ``--worker`` entry point.
    args
        Further command-line arguments.
    env
        Variables added to (or, with value ``""``, removed from) the parent's environment.
    timeout
        Seconds before the worker is killed.

    Raises
    ------
    DmlibError
        The worker failed, timed out or printed no JSON report; the message carries the
        tail of its stderr.
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_ROOT, full_env.get("PYTHONPATH", "")) if p
    )
    for key, value in (env or {}).items():
        if value == "":
            full_env.pop(key, None)
        else:
            full_env[key] = value
    cmd = [sys.executable, "-m", module, "--worker", *args]
    try:
        proc = subprocess.run(
            cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise DmlibError(f"worker {' '.join(cmd[2:])} ran past {timeout:.0f} s") from exc
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-8:]
        raise DmlibError(
            f"worker {' '.join(cmd[2:])} exited {proc.returncode}: " + " | ".join(tail)
        )
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise DmlibError(
            f"worker {' '.join(cmd[2:])} printed no JSON report (stdout: {proc.stdout[-200:]!r})"
        ) from exc
