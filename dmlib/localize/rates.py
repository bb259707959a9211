"""How often do repeats differ? Rates with Wilson 95% intervals, and the observer effect.

:func:`repeat_study` runs a function ``n`` times per arm (after one reference run) and
:func:`repeat_rates` computes, from outputs already made (tensors, arrays, checkpoint files,
capture folders), per arm: how many repeats differ bit for bit from the arm's reference,
that fraction with a Wilson score interval, and the number of distinct outputs. An
observer arm (the same runs with a capture on) is compared with the capture-off
reference; while it differs, capturing changes what is measured and no verdict is given.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError

Z95 = 1.959963984540054  # two-sided 95% normal quantile
COLUMNS = [
    "arm", "n", "n_differ", "rate", "ci_low", "ci_high", "n_distinct", "reference",
    "counts", "n_off_mode", "off_mode_rate", "off_mode_low", "off_mode_high",
]  # fmt: skip


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials (Wilson 1927).

    Centre ``(k + z^2/2) / (n + z^2)``, half-width
    ``z / (n + z^2) * sqrt(k (n - k) / n + z^2 / 4)``; ``(0, 1)`` when ``n == 0``.
    """
    if n < 0 or not 0 <= k <= n:
        raise DmlibError(f"wilson_interval needs 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    z2 = z * z
    centre = (k + z2 / 2) / (n + z2)
    half = z / (n + z2) * math.sqrt(k * (n - k) / n + z2 / 4)
    # at k = 0 (k = n) the bound is exactly 0 (1): centre and half-width are equal in
    # exact arithmetic, and their rounded difference would print as 1.39e-17
    lo = 0.0 if k == 0 else max(0.0, centre - half)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


def digest(obj: Any) -> str:
    """SHA-256 of an output's exact bits: tensors, arrays, nested tuples/lists/dicts,
    bytes, or a path (a checkpoint file by its tensor data, a capture folder by its
    boundary hashes)."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, obj: Any, top: bool = True) -> None:
    """Feed ``obj``'s exact value: ``top`` (the output itself) reads a str or path as a
    file or capture; inside a container a str is text."""
    text_inside = isinstance(obj, str) and not top
    if obj is None or text_inside or isinstance(obj, (bool, int, float)):
        _feed_scalar(h, obj)
        return
    if isinstance(obj, (str, os.PathLike)) and top:
        p = Path(obj)
        if (p / "manifest.json").is_file():
            from dmlib.localize.capture.reader import open_capture

            c = open_capture(p)
            for b in c.boundaries:
                # SHA-256 captures feed as they always did; other schemes carry their name
                tag = "" if b.hash == "sha256" else f"{b.hash}:"
                h.update(f"{b.name}\0{tag}{b.digest}\0".encode())
                for r, v in sorted(b.requests.items()):
                    h.update(f"{r}\0{tag}{v.digest}\0".encode())
            return
        from dmlib.io import open_tensors

        h.update(open_tensors(p).data_hash().encode())
        return
    if isinstance(obj, (bytes, bytearray, memoryview)):
        h.update(b"bytes\0")
        h.update(bytes(obj))
        return
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            h.update(f"key\0{k}\0".encode())
            _feed(h, obj[k], top=False)
        return
    if isinstance(obj, (tuple, list)):
        h.update(f"seq\0{len(obj)}\0".encode())
        for o in obj:
            _feed(h, o, top=False)
        return
    if type(obj).__module__.startswith("torch") and hasattr(obj, "detach"):
        from dmlib.localize.capture.tensors import _to_numpy

        obj = _to_numpy(obj)
    if isinstance(obj, (np.ndarray, np.generic)) and not np.asarray(obj).dtype.hasobject:
        a = np.asarray(obj)
        h.update(f"array\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())  # C order; a 0-d array's one value
        return
    raise DmlibError(
        f"cannot hash an output of type {type(obj).__name__} bit for bit; expected tensors, "
        "arrays, numbers, strings, None, bytes, or tuples, lists and dicts of them (a path "
        "as the output itself)"
    )


def _feed_scalar(h: Any, obj: Any) -> None:
    """A Python scalar by its exact value: an int of any size in decimal, a float by its
    bits (``float.hex``: -0.0 and 0.0 differ, as every NaN payload Python keeps), text as
    UTF-8; each tagged with its type, so that 1, 1.0, True and "1" all differ."""
    if obj is None:
        h.update(b"none\0")
    elif isinstance(obj, bool):
        h.update(b"bool\0" + (b"1" if obj else b"0"))
    elif isinstance(obj, int):
        h.update(f"int\0{obj}\0".encode())
    elif isinstance(obj, float):
        h.update(f"float\0{obj.hex()}\0".encode())
    else:
        text = str(obj).encode("utf-8", "surrogatepass")
        h.update(f"str\0{len(text)}\0".encode() + text)


@dataclass
class RepeatStudy:
    """Per-arm rates (``table``), the observer arm, and the verdict (None: withheld)."""

    table: pd.DataFrame
    observer: dict[str, Any] | None
    verdict: str | None
    reason: str

    def __bool__(self) -> bool:
        """True when the repeats were found deterministic (a verdict withheld is False)."""
        return self.verdict == "deterministic"

    def __str__(self) -> str:
        return f"{self.verdict or 'verdict withheld'}: {self.reason}"


def output_counts(digests: Sequence[str]) -> list[tuple[str, int]]:
    """(output digest, how many runs gave it), the most common first (a tie: the output
    seen first)."""
    counts: dict[str, int] = {}
    for d in digests:
        counts[d] = counts.get(d, 0) + 1
    order = {d: i for i, d in reversed(list(enumerate(digests)))}
    return sorted(counts.items(), key=lambda kv: (-kv[1], order[kv[0]]))


def _arm_row(arm: str, ref: str, digests: list[str]) -> dict[str, Any]:
    """One arm: repeats differing from the reference (``n_differ`` of ``n``), and over
    every run, the reference included, the distinct outputs' frequencies (``counts``) and
    the runs differing from the most common output, with a Wilson interval."""
    n = len(digests)
    k = sum(d != ref for d in digests)
    lo, hi = wilson_interval(k, n)
    runs = [ref, *digests]
    counts = output_counts(runs)
    off = len(runs) - counts[0][1]
    olo, ohi = wilson_interval(off, len(runs))
    return {"arm": arm, "n": n, "n_differ": k, "rate": k / n if n else float("nan"),
            "ci_low": lo, "ci_high": hi, "n_distinct": len(counts),
            "reference": ref[:16], "counts": [c for _, c in counts], "n_off_mode": off,
            "off_mode_rate": off / len(runs), "off_mode_low": olo,
            "off_mode_high": ohi}  # fmt: skip


def repeat_rates(
    arms: Mapping[str, Sequence[Any]],
    *,
    observer: Sequence[Any] | None = None,
    observer_arm: str | None = None,
) -> RepeatStudy:
    """Rates from outputs already made.

    Parameters
    ----------
    arms
        Arm name -> outputs; the first output is the arm's reference, the others are
        its repeats (at least one).
    observer
        Outputs of ``observer_arm`` (default: the first arm) made with a capture on;
        each is compared with that arm's capture-off reference.
    """
    return _from_digests(
        {arm: [digest(o) for o in outs] for arm, outs in arms.items()},
        None if observer is None else [digest(o) for o in observer],
        observer_arm,
    )


def _from_digests(
    arms: Mapping[str, list[str]], observer: list[str] | None, observer_arm: str | None
) -> RepeatStudy:
    if not arms:
        raise DmlibError("repeat_rates needs at least one arm")
    rows, refs = [], {}
    for arm, ds in arms.items():
        if len(ds) < 2:
            raise DmlibError(f"arm {arm!r} has {len(ds)} output(s); need a reference and a repeat")
        refs[arm] = ds[0]
        rows.append(_arm_row(arm, ds[0], ds[1:]))
    obs = None
    if observer is not None:
        base = observer_arm or next(iter(arms))
        if base not in refs:
            raise DmlibError(f"observer arm {base!r} is not among the arms {list(arms)}")
        if not observer:
            raise DmlibError("the observer arm has no outputs")
        row = _arm_row(f"observer ({base}, capture on)", refs[base], observer)
        rows.append(row)
        obs = {"arm": base, "n": row["n"], "n_differ": row["n_differ"],
               "held": row["n_differ"] == 0}  # fmt: skip
    table = pd.DataFrame(rows, columns=COLUMNS)
    return _verdict(table, obs)


def _verdict(table: pd.DataFrame, obs: dict[str, Any] | None) -> RepeatStudy:
    if obs is not None and not obs["held"]:
        return RepeatStudy(table, obs, None, (
            f"capturing changes the outputs ({obs['n_differ']} of {obs['n']} captured runs differ "
            f"from the uncaptured reference of arm {obs['arm']!r}): rates measured under capture "
            "would not describe the uncaptured runs"))  # fmt: skip
    arms = table[~table["arm"].str.startswith("observer (")]
    noisy = arms[arms["n_differ"] > 0]
    tail = "" if obs is not None else "; no observer arm was run (capture effect unknown)"
    if noisy.empty:
        worst = arms["ci_high"].max()
        return RepeatStudy(table, obs, "deterministic", (
            f"no repeat differs from its arm's reference in any arm (rate 0, upper 95% bound "
            f"{worst:.3g}){tail}"))  # fmt: skip
    parts = [f"{r.arm}: {r.n_differ}/{r.n} = {r.rate:.3g} [{r.ci_low:.3g}, {r.ci_high:.3g}], "
             f"{r.n_distinct} distinct (runs per output {r.counts}; {r.n_off_mode} of "
             f"{r.n + 1} differ from the most common, {r.off_mode_rate:.3g} "
             f"[{r.off_mode_low:.3g}, {r.off_mode_high:.3g}])"
             for r in noisy.itertuples()]  # fmt: skip
    return RepeatStudy(table, obs, "nondeterministic", "; ".join(parts) + tail)


def repeat_study(
    fn: Callable[..., Any],
    *,
    n: int,
    arms: Mapping[str, Any] | None = None,
    observer: Callable[[str, int], Any] | None = None,
    observer_arm: str | None = None,
) -> RepeatStudy:
    """Run ``fn`` once as reference and ``n`` times as repeats per arm; see :func:`repeat_rates`.

    Parameters
    ----------
    fn
        ``fn(value)`` for each arm's value (``fn()`` when ``arms`` is None); returns the
        output compared bit for bit (tensors, arrays, nested containers, a file path).
    n
        Repeats per arm (besides the reference run).
    arms
        Arm name -> the value passed to ``fn``.
    observer
        ``observer(arm, i)`` returns a context manager (e.g. ``dmlib.capture(...)`` into
        a fresh folder) under which ``fn`` runs ``n`` more times for ``observer_arm``
        (default: the first arm): the observer arm.
    """
    if n < 1:
        raise DmlibError(f"n={n}; need at least one repeat per arm")
    values = {"default": None} if arms is None else dict(arms)

    def call(v: Any) -> Any:
        return fn() if arms is None else fn(v)

    outs = {arm: [digest(call(v)) for _ in range(n + 1)] for arm, v in values.items()}
    obs_outs = None
    if observer is not None:
        base = observer_arm or next(iter(values))
        obs_outs = []
        for i in range(n):
            with observer(base, i):
                obs_outs.append(digest(call(values[base])))
    return _from_digests(outs, obs_outs, observer_arm)


__all__ = [
    "RepeatStudy", "digest", "output_counts", "repeat_rates", "repeat_study", "wilson_interval",
    "Z95",
]  # fmt: skip
