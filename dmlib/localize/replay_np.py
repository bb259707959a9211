"""Float64 replay of recorded ops in numpy, for machines (and report kernels) without torch.

:func:`dmlib.localize.arbitrate.replay64` replays an op through ``torch.ops`` when torch
is importable. Reading a capture needs no torch, and a report that only arbitrates
committed dumps should not need it either: this module recomputes the ops whose rounding
usually matters from the recorded arguments, with the argument order of ATen's schemas
(``native_functions.yaml``) written out below because without torch no schema can be
asked for. Convolutions and custom operators have no numpy replay: they need torch or a
``reference`` callable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dmlib.errors import CaptureError

# positional parameter names per op (ATen schema order); keyword-only ones come as kwargs
_PARAMS: dict[str, tuple[str, ...]] = {
    "aten.mm": ("self", "mat2"),
    "aten.addmm": ("self", "mat1", "mat2", "beta", "alpha"),
    "aten.matmul": ("self", "other"),
    "aten.linear": ("input", "weight", "bias"),
    "aten.bmm": ("self", "mat2"),
    "aten.baddbmm": ("self", "batch1", "batch2", "beta", "alpha"),
    "aten.mv": ("self", "vec"),
    "aten.addmv": ("self", "mat", "vec", "beta", "alpha"),
    "aten.dot": ("self", "tensor"),
    "aten._softmax": ("self", "dim", "half_to_float"),
    "aten.softmax": ("self", "dim", "dtype"),
    "aten._log_softmax": ("self", "dim", "half_to_float"),
    "aten.log_softmax": ("self", "dim", "dtype"),
    "aten.native_layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
    "aten.layer_norm": ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
    "aten.sum": ("self", "dim", "keepdim", "dtype"),
    "aten.mean": ("self", "dim", "keepdim", "dtype"),
    "aten.cumsum": ("self", "dim", "dtype"),
    "aten._scaled_dot_product_flash_attention_for_cpu": (
        "query", "key", "value", "dropout_p", "is_causal"),
    "aten.scaled_dot_product_attention": (
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    "aten._scaled_dot_product_attention_math": (
        "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "dropout_mask"),
}  # fmt: skip


def _bind(op: str, overload: str, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    params = _PARAMS[op]
    if op in ("aten.sum", "aten.mean") and overload == "default":
        params = ("self", "dtype")  # the overload without dims
    if len(args) > len(params):
        raise CaptureError(f"{op}.{overload}: {len(args)} arguments, its schema has {len(params)}")
    bound = dict(zip(params, args))
    bound.update(kwargs)
    return bound


def _scalar(v: Any, default: float) -> float:
    return default if v is None else float(v)


def _softmax(x: np.ndarray, dim: int) -> np.ndarray:
    z = x - np.max(x, axis=dim, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=dim, keepdims=True)


def _attention(p: dict[str, Any]) -> np.ndarray:
    q, k, v = p["query"], p["key"], p["value"]
    if float(p.get("dropout_p") or 0.0) != 0.0:
        raise CaptureError("attention with dropout cannot be replayed (its mask is random)")
    if p.get("enable_gqa") and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, rep, axis=-3), np.repeat(v, rep, axis=-3)
    scale = p.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    mask = p.get("attn_mask")
    if p.get("is_causal"):
        lq, lk = s.shape[-2], s.shape[-1]
        s = np.where(np.tril(np.ones((lq, lk), dtype=bool)), s, -np.inf)
    if mask is not None:
        m = np.asarray(mask)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m
    return np.matmul(_softmax(s, -1), v)


def _layer_norm(p: dict[str, Any]) -> np.ndarray:
    x = p["input"]
    axes = tuple(range(x.ndim - len(p["normalized_shape"]), x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mu) / np.sqrt(var + float(p["eps"]))
    if p.get("weight") is not None:
        y = y * p["weight"]
    if p.get("bias") is not None:
        y = y + p["bias"]
    return y


def _reduce(fn: Callable[..., np.ndarray], p: dict[str, Any]) -> np.ndarray:
    dim = p.get("dim")
    axis = None if dim is None or dim == [] else tuple(np.atleast_1d(dim).tolist())
    return np.asarray(fn(p["self"], axis=axis, keepdims=bool(p.get("keepdim", False))))


def _linear(p: dict[str, Any]) -> np.ndarray:
    y = np.matmul(p["input"], np.swapaxes(p["weight"], -1, -2))
    return y if p.get("bias") is None else y + p["bias"]


def _plus(scaled: str, prod: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    return _scalar(p.get("beta"), 1.0) * p[scaled] + _scalar(p.get("alpha"), 1.0) * prod


_REPLAY: dict[str, Callable[[dict[str, Any]], np.ndarray]] = {
    "aten.mm": lambda p: np.matmul(p["self"], p["mat2"]),
    "aten.matmul": lambda p: np.matmul(p["self"], p["other"]),
    "aten.bmm": lambda p: np.matmul(p["self"], p["mat2"]),
    "aten.mv": lambda p: np.matmul(p["self"], p["vec"]),
    "aten.dot": lambda p: np.asarray(np.dot(p["self"], p["tensor"])),
    "aten.addmm": lambda p: _plus("self", np.matmul(p["mat1"], p["mat2"]), p),
    "aten.baddbmm": lambda p: _plus("self", np.matmul(p["batch1"], p["batch2"]), p),
    "aten.addmv": lambda p: _plus("self", np.matmul(p["mat"], p["vec"]), p),
    "aten.linear": _linear,
    "aten._softmax": lambda p: _softmax(p["self"], int(p["dim"])),
    "aten.softmax": lambda p: _softmax(p["self"], int(p["dim"])),
    "aten._log_softmax": lambda p: np.log(_softmax(p["self"], int(p["dim"]))),
    "aten.log_softmax": lambda p: np.log(_softmax(p["self"], int(p["dim"]))),
    "aten.native_layer_norm": _layer_norm,
    "aten.layer_norm": _layer_norm,
    "aten.sum": lambda p: _reduce(np.sum, p),
    "aten.mean": lambda p: _reduce(np.mean, p),
    "aten.cumsum": lambda p: np.cumsum(p["self"], axis=int(p["dim"])),
    "aten._scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten.scaled_dot_product_attention": _attention,
    "aten._scaled_dot_product_attention_math": _attention,
}

REPLAYABLE_NUMPY = frozenset(_REPLAY)


def replay_numpy(op: str, args: list[Any], kwargs: dict[str, Any]) -> np.ndarray:
    """The first output of ``op`` (``"aten.addmm.default"``) in float64, from decoded
    arguments (float tensors already float64 numpy arrays)."""
    name, _, overload = op.rpartition(".") if op.count(".") >= 2 else (op, "", "default")
    if name not in _REPLAY:
        raise CaptureError(f"no numpy float64 replay for {op} (install torch, or pass reference=)")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return np.asarray(_REPLAY[name](_bind(name, overload, args, kwargs)), dtype=np.float64)


__all__ = ["REPLAYABLE_NUMPY", "replay_numpy"]
