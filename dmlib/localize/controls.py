"""The controls that qualify a comparison of captures, and the element statistics they
and the comparison share.

A repeat control (two captures of one layout must be byte-identical, else differences
between layouts cannot be told from run-to-run noise) and a negative control (a one-bit
change planted in a dumped tensor must be found; optionally a capture of a different
input must differ). :func:`dmlib.localize.boundaries.compare_captures` runs them.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dmlib.dtypes import bits_dtype
from dmlib.localize.capture.digests import request_hashes
from dmlib.localize.capture.format import (
    request_key,
    same_scheme,
)
from dmlib.localize.capture.reader import Capture, lift_blake3, open_capture

CaptureLike = Capture | str | os.PathLike
#: the element statistics of a boundary whose values were not compared
NO_STATS = {"n_diff": None, "n_diff_rows": None, "max_abs": None, "rel_fro": None, "max_ulp": None}


def element_stats(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """n_diff, n_diff_rows (leading index), max_abs, rel_fro (to ``a``) and max_ulp.

    The statistics of :func:`dmlib.compare`'s row (:func:`dmlib.kernels.pair.compare_arrays`),
    so the NaN policy is the comparison's: a NaN equals a NaN with the same bits, and pairs
    involving a NaN or an infinity count in ``n_diff`` but never enter ``max_abs``,
    ``rel_fro`` or ``max_ulp``. ``rel_fro`` and ``max_ulp`` are None for integer and bool
    tensors; every value is None when the dtypes or shapes differ.
    """
    from dmlib.kernels.pair import compare_arrays

    if a.shape != b.shape or a.dtype != b.dtype:
        return dict(NO_STATS)
    row = compare_arrays(a, b)
    max_abs = row["max_abs"]
    return {
        "n_diff": int(row["n_diff"]),
        "n_diff_rows": _diff_rows(a, b),
        "max_abs": None if max_abs is None or max_abs != max_abs else float(max_abs),
        "rel_fro": row.get("rel_fro"),
        "max_ulp": row.get("max_ulp"),
    }


def _diff_rows(a: np.ndarray, b: np.ndarray) -> int:
    """Rows (indices of the leading axis) holding a differing bit pattern (0-d: the value)."""
    if a.ndim == 0:
        return int(a.tobytes() != b.tobytes())
    if a.shape[0] == 0 or a.size == 0:
        return 0
    ua = np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.uint8)
    ub = np.ascontiguousarray(b).reshape(b.shape[0], -1).view(np.uint8)
    return int(np.count_nonzero((ua != ub).any(axis=1)))


def repeat_control(a: CaptureLike, a_repeat: CaptureLike) -> dict[str, Any]:
    """Two captures of one layout must be byte-identical at every boundary.

    Returns ``{"a", "repeat", "held", "n_boundaries", "n_differing", "differing",
    "n_incomparable", "incomparable"}``; a boundary hashed with two schemes cannot show
    that the repeat held, so it counts against it (listed under ``incomparable``).
    """
    ca, cr = lift_blake3(open_capture(a), open_capture(a_repeat))
    names_a = [x.name for x in ca.boundaries]
    names_r = [x.name for x in cr.boundaries]
    differing, incomparable = [], []
    for x in ca.boundaries:
        y = cr.boundary(x.name) if x.name in cr else None
        if y is not None and not same_scheme(x, y):
            incomparable.append(x.name)
        elif (
            y is None
            or (x.digest, x.shape, x.dtype) != (y.digest, y.shape, y.dtype)
            or {k: v.digest for k, v in x.requests.items()}
            != {k: v.digest for k, v in y.requests.items()}
        ):
            differing.append(x.name)
    missing = sorted(set(names_r) - set(names_a))
    return {
        "a": str(ca.path),
        "repeat": str(cr.path),
        "held": not differing and not missing and not incomparable,
        "n_boundaries": len(names_a),
        "n_differing": len(differing) + len(missing),
        "differing": (differing + missing)[:20],
        "n_incomparable": len(incomparable),
        "incomparable": incomparable[:20],
    }


def planted_control(
    a: CaptureLike, *, request: Any = None, boundary: str | None = None
) -> dict[str, Any]:
    """Negative control: a one-bit change planted in a dumped tensor must be detected.

    Recomputes the request's hashes from the dumped rows (they must equal the manifest:
    the hashes describe these bytes), flips the lowest bit of one element in the middle
    block, and requires that exactly that block's hash (and the whole hash) change and
    that the element statistics count exactly one differing element.
    """
    c = open_capture(a)
    reqs = [request_key(request)] if request is not None else sorted(c.requests)
    candidates = [
        (x, r)
        for x in c.boundaries
        for r in reqs
        if x.row_mapped
        and r in x.requests
        and c.dumped(x, r)
        and (boundary is None or x.name == boundary)
    ]
    if not candidates:
        return {
            "kind": "planted",
            "passed": None,
            "reason": "no dumped row-mapped boundary to plant in",
        }
    x, r = candidates[0]
    rows = np.array(c.tensor(x, r))
    scheme = x.hash
    sha, blocks = request_hashes(rows, c.block_rows, scheme)
    matches = sha == x.requests[r].digest and blocks == x.requests[r].blocks
    k = len(blocks) // 2
    pos = min(k * c.block_rows, rows.shape[0] - 1)
    flat = rows.reshape(rows.shape[0], -1).view(
        bits_dtype(rows.dtype) if rows.dtype != np.bool_ else np.uint8
    )
    flat[pos, 0] ^= 1
    sha2, blocks2 = request_hashes(rows, c.block_rows, scheme)
    flagged = [i for i, (p, q) in enumerate(zip(blocks, blocks2, strict=True)) if p != q]
    n_diff = element_stats(np.asarray(c.tensor(x, r)), rows)["n_diff"]
    passed = bool(matches and sha2 != sha and flagged == [k] and n_diff == 1)
    return {
        "kind": "planted", "boundary": x.name, "request": r, "position": int(pos), "block": k,
        "hashes_match_dump": bool(matches), "blocks_flagged": flagged, "n_diff": n_diff, "passed": passed,
    }  # fmt: skip


def _repeats(
    a: Capture, b: Capture, repeat: CaptureLike | tuple[CaptureLike, ...] | None
) -> dict[str, Any] | None:
    if repeat is None:
        return None
    reps = list(repeat) if isinstance(repeat, (tuple, list)) else [repeat]
    checks = [repeat_control(base, rep) for base, rep in zip((a, b), reps, strict=False)]
    return {"held": all(c["held"] for c in checks), "checks": checks}


def _negatives(
    a: Capture, b: Capture, requests: list[str], negative: CaptureLike | None
) -> dict[str, Any]:
    checks = [planted_control(a, request=requests[0] if len(requests) == 1 else None)]
    if negative is not None:
        la, n = lift_blake3(a, open_capture(negative))
        common = sorted(set(a.requests) & set(n.requests)) or None
        found = False
        for x in la.boundaries:
            if x.name not in n:
                continue
            y = n.boundary(x.name)
            if not same_scheme(x, y):  # two schemes' digests differ whatever the bytes
                continue
            if common and x.row_mapped and y.row_mapped:
                found |= any(x.requests[r].digest != y.requests[r].digest for r in common)
            else:
                found |= x.digest != y.digest
        checks.append({"kind": "different-input", "capture": str(n.path), "passed": bool(found)})
    verdicts = [c["passed"] for c in checks if c["passed"] is not None]
    return {"passed": (all(verdicts) if verdicts else None), "checks": checks}


__all__ = ["element_stats", "planted_control", "repeat_control"]
