"""fp64 arbitration: which of two runs of a culprit op is closer to the exact result?

For an op captured with ``ops=True`` whose tensors were dumped whole in both captures,
:func:`arbitrate` replays the op in float64 from each run's own recorded inputs (the
same overload and the recorded non-tensor arguments; float tensors and float dtype
arguments promoted to float64) and measures each run's output against that reference:
ULP of the output dtype (against the reference rounded to nearest in that dtype, so 0
means correctly rounded) and the relative error ``||out - ref||_2 / ||ref||_2``.
That tells "both round differently, both within N ULP of exact" from "one run is wrong".

Replay is built in for the ops whose rounding usually matters (matmul / addmm / linear,
bmm, attention, softmax, layer_norm, sum / mean, convolution); any other op, a custom
operator included, needs a float64 ``reference`` callable. Float64 is not exact either:
its own error (about 1e-16 relative) is far below one float32 or float16 ULP, which is
what the comparison needs.

The replay runs in numpy (:mod:`dmlib.localize.replay_np`: the same ops but convolution)
unless torch is imported already or the op needs it, so reading and arbitrating committed
dumps never imports torch; ``backend=`` chooses explicitly.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import CaptureError
from dmlib.localize.capture.format import request_key
from dmlib.localize.capture.reader import Capture, open_capture
from dmlib.localize.opalign import OpInfo, align, op_table

# aten ops replayed as recorded (in float64); others need a reference callable
REPLAYABLE = {
    "aten.mm", "aten.addmm", "aten.matmul", "aten.linear", "aten.bmm", "aten.baddbmm",
    "aten.mv", "aten.addmv", "aten.dot",
    "aten._scaled_dot_product_flash_attention_for_cpu", "aten.scaled_dot_product_attention",
    "aten._scaled_dot_product_attention_math", "aten._softmax", "aten.softmax",
    "aten._log_softmax", "aten.log_softmax", "aten.native_layer_norm", "aten.layer_norm",
    "aten.sum", "aten.mean", "aten.convolution", "aten.conv1d", "aten.conv2d", "aten.conv3d",
    "aten._convolution", "aten.cumsum",
}  # fmt: skip

COLUMNS = ["run", "op", "dtype", "n", "max_ulp", "median_ulp", "frac_exact", "max_abs", "rel_err"]


@dataclass
class Arbitration:
    """Each run's distance to float64; ``verdict`` in ``both-close``, ``a-departs``,
    ``b-departs``, ``inconclusive``. True when a verdict was reached and no run departs."""

    op: str
    verdict: str
    reason: str
    table: pd.DataFrame

    def __bool__(self) -> bool:
        return self.verdict == "both-close"

    def __str__(self) -> str:
        return f"fp64 arbitration of {self.op}: {self.verdict}: {self.reason}"


def _name(op: str) -> str:
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def _decode(v: Any, tensors: Callable[[str], Any]) -> Any:
    import torch

    if isinstance(v, list):
        return [_decode(x, tensors) for x in v]
    if not isinstance(v, dict):
        return v
    if "tensor" in v:
        if v["tensor"] is None:
            raise CaptureError("an argument tensor was not recorded")
        return tensors(v["tensor"])
    if "dtype" in v:
        dt = getattr(torch, v["dtype"])
        return torch.float64 if dt.is_floating_point else dt
    if "float" in v:
        return float(v["float"])
    if "device" in v:
        return torch.device("cpu")
    if "layout" in v:
        return getattr(torch, v["layout"])
    if "memory_format" in v:
        return getattr(torch, v["memory_format"])
    raise CaptureError(f"argument {v!r} cannot be replayed")


def _decode_np(v: Any, tensors: Callable[[str], Any]) -> Any:
    if isinstance(v, list):
        return [_decode_np(x, tensors) for x in v]
    if not isinstance(v, dict):
        return v
    if "tensor" in v:
        if v["tensor"] is None:
            raise CaptureError("an argument tensor was not recorded")
        return tensors(v["tensor"])
    if "float" in v:
        return float(v["float"])
    if any(k in v for k in ("dtype", "device", "layout", "memory_format")):
        return None  # float64 throughout; where and how the run stored it does not matter
    raise CaptureError(f"argument {v!r} cannot be replayed")


def _np64(arr: np.ndarray) -> np.ndarray:
    a = np.asarray(arr)
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return a.astype(np.float64)
    return np.array(a, copy=True)


def _backend(backend: str, op: str | None = None) -> str:
    """The backend a replay of ``op`` runs on.

    ``"auto"`` keeps torch out of a process that has not imported it: numpy replays
    every op it knows, torch (where importable) only the others (convolution) or where
    torch is loaded already.
    """
    if backend not in ("auto", "torch", "numpy"):
        raise CaptureError(f"backend {backend!r}: expected 'auto', 'torch' or 'numpy'")
    if backend != "auto":
        return backend
    if "torch" in sys.modules:
        return "torch"
    from dmlib.localize.replay_np import REPLAYABLE_NUMPY

    if op is None or _name(op) in REPLAYABLE_NUMPY or op in REPLAYABLE_NUMPY:
        return "numpy"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


def _torch64(arr: np.ndarray) -> Any:
    import torch

    a = np.asarray(arr)
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return torch.from_numpy(a.astype(np.float64))
    return torch.from_numpy(np.array(a, copy=True))


def replay64(
    cap: Capture,
    op: OpInfo,
    reference: Callable[..., Any] | None = None,
    *,
    backend: str = "auto",
) -> np.ndarray:
    """The op's first output recomputed in float64 from this capture's whole dumps.

    ``backend``: ``"torch"`` (``torch.ops``), ``"numpy"`` (:mod:`~dmlib.localize.replay_np`)
    or ``"auto"`` (see :func:`arbitrate`). A ``reference`` callable gets numpy arrays
    under the numpy backend, torch tensors otherwise.
    """
    if _backend(backend, op.op) == "numpy":
        return _replay_numpy(cap, op, reference)
    import torch

    def tensor(name: str) -> Any:
        if not cap.dumped(name):
            raise CaptureError(
                f"input {name!r} was not dumped whole; fp64 replay needs the op's whole "
                "inputs (capture with dump= matching them and no dump_requests)",
                path=cap.path,
            )
        return _torch64(cap.tensor(name))

    args = [_decode(a, tensor) for a in op.args]
    kwargs = {k: _decode(v, tensor) for k, v in op.kwargs.items()}
    if reference is None:
        if _name(op.op) not in REPLAYABLE:
            raise CaptureError(
                f"no float64 replay for {op.op}; pass reference={{{_name(op.op)!r}: fn}}",
                path=cap.path,
            )
        ns, name, overload = op.op.split(".", 2)
        fn = getattr(getattr(getattr(torch.ops, ns), name), overload)
    else:
        fn = reference
    with torch.no_grad():
        out = fn(*args, **kwargs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.detach().to(torch.float64).numpy()


def _replay_numpy(cap: Capture, op: OpInfo, reference: Callable[..., Any] | None) -> np.ndarray:
    from dmlib.localize.replay_np import replay_numpy

    def tensor(name: str) -> np.ndarray:
        if not cap.dumped(name):
            raise CaptureError(
                f"input {name!r} was not dumped whole; fp64 replay needs the op's whole "
                "inputs (capture with dump= matching them and no dump_requests)",
                path=cap.path,
            )
        return _np64(cap.tensor(name))

    args = [_decode_np(a, tensor) for a in op.args]
    kwargs = {k: _decode_np(v, tensor) for k, v in op.kwargs.items()}
    if reference is not None:
        out = reference(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return np.asarray(out, dtype=np.float64)
    try:
        return replay_numpy(op.op, args, kwargs)
    except CaptureError as err:
        raise CaptureError(err.message, path=cap.path) from None


def distances(out: np.ndarray, ref64: np.ndarray) -> dict[str, Any]:
    """max/median ULP of ``out``'s dtype from ``ref64`` rounded to it, frac_exact, max_abs,
    rel_err."""
    from dmlib.kernels.ulp import ulp_distance

    out = np.asarray(out)
    ref64 = np.asarray(ref64, dtype=np.float64)
    if out.shape != ref64.shape:
        raise CaptureError(f"output {list(out.shape)} vs float64 replay {list(ref64.shape)}")
    ulp = ulp_distance(out, ref64.astype(out.dtype)) if out.size else np.zeros(0, np.uint64)
    diff = out.astype(np.float64) - ref64
    # pairwise sums, not BLAS: np.linalg.norm's dot changes its last bits with the thread count
    den = math.sqrt(float(np.sum(np.square(ref64))))
    num = math.sqrt(float(np.sum(np.square(diff))))
    return {
        "dtype": out.dtype.name,
        "n": int(out.size),
        "max_ulp": int(ulp.max()) if ulp.size else 0,
        "median_ulp": float(np.median(ulp)) if ulp.size else 0.0,
        "frac_exact": float(np.mean(ulp == 0)) if ulp.size else 1.0,
        "max_abs": float(np.abs(diff).max()) if diff.size else 0.0,
        "rel_err": num / den if den > 0 else (0.0 if num == 0 else float("inf")),
    }


def _rows(cap: Capture, name: str, whole: np.ndarray, request: str | None) -> np.ndarray:
    b = cap.boundary(name)
    if request is None or not b.row_mapped or cap.row_map is None:
        return whole
    return b.physical_rows(whole)[cap.row_map.requests[request]]


def arbitrate(
    a: Capture | str | os.PathLike[str],
    b: Capture | str | os.PathLike[str],
    op: str | None = None,
    *,
    request: Any = None,
    reference: Mapping[str, Callable[..., Any]] | None = None,
    factor: float = 10.0,
    backend: str = "auto",
) -> Arbitration:
    """Measure both runs of one op against its float64 replay.

    Parameters
    ----------
    a, b
        Captures made with ``ops=True`` holding whole dumps of the op's tensors.
    op
        Op id in ``a`` (``"enc.layer.0.attention.self/aten.addmm#0"``); default: the
        culprit op of :func:`dmlib.compare_captures`. Its partner in ``b`` comes from
        the aligned op sequences.
    request
        Measure only this request's rows (where the output keeps the row layout).
    reference
        Float64 reference per op name (``{"mylib.quirk": fn}``), for custom ops or to
        override the replay; called with the recorded arguments.
    factor
        A run "departs" when its relative error exceeds the other's by this factor and
        it is not within one ULP everywhere.
    backend
        Where the float64 replay runs: ``"torch"``, ``"numpy"`` (no torch needed; no
        convolution) or ``"auto"`` (numpy for the ops it replays unless torch is
        imported already; torch for the others).
    """
    _backend(backend)
    ca = a if isinstance(a, Capture) else open_capture(a)
    cb = b if isinstance(b, Capture) else open_capture(b)
    key = None if request is None else request_key(request)
    if op is None:
        from dmlib.localize.boundaries import compare_captures

        op = compare_captures(ca, cb, request=request).attrs["culprit_op"]
        if op is None:
            return Arbitration("(none)", "inconclusive", "the comparison names no culprit op",
                               pd.DataFrame(columns=COLUMNS))  # fmt: skip
    ops_a = {o.id: o for o in op_table(ca)}
    op = op.partition(":")[0]  # a boundary of the op (``...#0:output1``) names the op
    if op not in ops_a:
        raise CaptureError(f"no op {op!r} in this capture (made with ops=True?)", path=ca.path)
    oa = ops_a[op]
    partner = align(ca, cb).partner.get(op)
    ob = next((o for o in op_table(cb) if partner is not None and o.id == partner), None)
    if ob is None or not oa.outputs or not ob.outputs:
        return Arbitration(op, "inconclusive", f"op {op} has no recorded partner output in {cb.path}",
                           pd.DataFrame(columns=COLUMNS))  # fmt: skip
    ref = (reference or {}).get(_name(oa.op)) or (reference or {}).get(oa.op)
    rows = []
    for label, cap, o in (("a", ca, oa), ("b", cb, ob)):
        try:
            ref64 = replay64(cap, o, ref, backend=backend)
            out = cap.tensor(o.outputs[0])
        except CaptureError as err:
            return Arbitration(op, "inconclusive", f"run {label}: {err.message}",
                               pd.DataFrame(columns=COLUMNS))  # fmt: skip
        d = distances(
            _rows(cap, o.outputs[0], np.asarray(out), key),
            _rows(cap, o.outputs[0], ref64, key),
        )
        rows.append({"run": label, "op": o.id, **d})
    t = pd.DataFrame(rows, columns=COLUMNS)
    verdict, reason = _verdict(t, factor)
    return Arbitration(op, verdict, reason, t)


def _verdict(t: pd.DataFrame, factor: float) -> tuple[str, str]:
    ra, rb = (t.set_index("run").loc[r] for r in ("a", "b"))
    if not (np.isfinite(ra["rel_err"]) and np.isfinite(rb["rel_err"])):
        return "inconclusive", "a relative error is not finite (zero reference or NaN)"
    for bad, good, name in ((ra, rb, "a"), (rb, ra, "b")):
        if bad["max_ulp"] > 1 and bad["rel_err"] > factor * good["rel_err"]:
            return f"{name}-departs", (
                f"run {name} is {bad['max_ulp']} ULP ({bad['dtype']}) from float64 at worst, rel "
                f"error {bad['rel_err']:.3g}; the other run {good['max_ulp']} ULP, "
                f"{good['rel_err']:.3g}"
            )
    n = max(ra["max_ulp"], rb["max_ulp"])
    return "both-close", (
        f"both runs within {n} ULP ({ra['dtype']}) of float64 at worst (median "
        f"{ra['median_ulp']:g} and {rb['median_ulp']:g}; rel errors {ra['rel_err']:.3g} and "
        f"{rb['rel_err']:.3g}): they round differently, neither departs by {factor:g}x"
    )


__all__ = ["Arbitration", "arbitrate", "distances", "replay64", "REPLAYABLE"]
