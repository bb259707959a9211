"""LoRA adapters judged by the weight they add, and merges checked against base + adapter.

A PEFT LoRA adapter stores, for every target module, two factors: ``lora_A`` [r, in] and
``lora_B`` [out, r]. What the adapter changes is the weight it adds to the module,

    delta = scaling * B @ A,   scaling = lora_alpha / r   (use_rslora: lora_alpha / sqrt(r))

(transposed where ``fan_in_fan_out``; for an embedding, ``(B @ A).T`` over
``lora_embedding_A`` / ``lora_embedding_B``), with ``r`` and ``lora_alpha`` per module from
``rank_pattern`` / ``alpha_pattern`` (a key matches a module whose dotted path ends with it,
the first key in the file's order that matches wins, as PEFT resolves them). The factors are
not unique: ``A -> P A, B -> B P^T`` for a permutation ``P`` (or any invertible matrix)
adds the same weight. So two adapters are compared by their deltas.

**The bound of a rank-permuted adapter.** Both deltas are formed in float64 from the stored
factors (exact in float64 for float32/bfloat16/float16 factors). Each element is a dot
product of ``r`` terms, then one multiplication by ``scaling`` (itself one or two roundings
of ``lora_alpha / r``, or of ``lora_alpha / sqrt(r)``). By the standard error bound of a
dot product in floating point (Higham, *Accuracy and Stability of Numerical Algorithms*,
3.1), a computed element lies within ``gamma(r + 3) * scaling * (|B| @ |A|)_ij`` of the
exact value, where ``gamma(n) = n u / (1 - n u)`` and ``u = 2**-53`` (float64's unit
roundoff); ``|B| @ |A|`` is itself formed in float64 from non-negative terms, which one
more ``gamma`` step covers: this module uses ``gamma(r + 4)``. Two adapters whose exact
deltas are equal can therefore differ, once computed, by at most the sum of the two sides'
bounds, element by element. A pair inside that bound everywhere is **equal** (the
difference is the rounding of dmlib's own product, not of the adapters), and the report
states the bound and the observed difference in ULP of the product's dtype (the dtype the
factors hold: the finer of A's and B's), at the element's largest term,
``scaling * (|B| @ |A|)_ij`` (an element whose terms cancel is small, and its own ULP says
nothing of the product's rounding). Outside it anywhere:
**different**. Bit-identical factors and equal scalings: **identical**.

**The merge check.** ``merged = base + delta`` is checked element by element against
``E = W + scaling * B @ A`` formed in float64 from the base, the adapter and its config.
A merge computed in dtype ``T`` (unit roundoff ``u_T``) with the product accumulated in
``acc`` (float32 for 16- and 32-bit merges, as PEFT on CPU and GPU matmuls do; float64 for
float64; unit roundoff ``u_a``) rounds the product (``gamma(r + 3)`` in ``u_a``, as above),
may round the delta to ``T`` (``u_T |delta|``), and rounds the sum once in ``T``, possibly
after a rounding to ``acc`` (``(u_T + 2 u_a) |merged|``, double rounding included). So

    |merged - E| <= (1 + 4 u_T) * ((u_T + 2 u_a) |merged| + u_T |delta|
                                   + gamma_a(r + 3) scaling (|B| @ |A|))
                    + gamma(r + 4) (|W| + scaling (|B| @ |A|))      (E's own float64 error)

element by element. Each target's largest ``|merged - E|`` and largest bound are reported
in ULP of ``T`` at the element's largest term (``max(|merged|, |W|, scaling (|B| @
|A|)_ij)``: where ``W + delta``, or the product itself, cancels, the merged element is small
and its own ULP says nothing of the merge's rounding, which is that of its terms). A target with any element outside is named. Every
tensor the adapter does not touch must be bit-identical in merged and base. DoRA targets
(a ``lora_magnitude_vector``) and adapters with other trainable parts (``lora_B`` biases)
are reported as not checked, never as passed.

**Names.** PEFT saves ``base_model.model.<module>.lora_A.weight``; the base model holds
``<module>.weight`` (``model.layers.0.self_attn.q_proj.weight`` for a causal LM saved by
``save_pretrained``). A module path not found as is in the base is looked up with its
leading dotted components dropped one at a time (a base saved without its ``model.``
prefix); two candidates, or none, are refused naming the module. Tensors the adapter saves
whole (``modules_to_save``, a ``base_layer`` copy) are compared as tensors:
``.base_layer`` and ``.modules_to_save.<adapter name>`` are dropped from their names.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dmlib._blas import one_thread
from dmlib.errors import DmlibError, FormatError, TensorNotFoundError, UnsupportedError
from dmlib.forensics.factors import FactorGroup
from dmlib.io.hf_pretrained import is_adapter
from dmlib.kernels.verdict import Verdict, cell
from dmlib.sources import Source, open_source
from dmlib.tensor import TensorSet
from dmlib.textsafe import names_list, shown

__all__ = [
    "Adapter",
    "AdapterConfig",
    "AdapterVerdict",
    "MergeVerdict",
    "check_merge",
    "compare_adapters",
    "is_adapter",
    "open_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
_U64 = 2.0**-53
_PREFIX = "base_model.model."
_PART = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_embedding_A|"
    r"lora_embedding_B|lora_magnitude_vector(?:\.weight)?)$"
)
# the factor pair of each kind of target: (A part, B part)
_KINDS = {"linear": ("lora_A.weight", "lora_B.weight"),
          "embedding": ("lora_embedding_A", "lora_embedding_B")}  # fmt: skip


def gamma(n: int, u: float = _U64) -> float:
    """``n u / (1 - n u)``: the relative error bound of ``n`` roundings of unit roundoff ``u``."""
    return n * u / (1.0 - n * u)


# -- the config ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says about the weight a LoRA adapter adds."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    use_dora: bool = False
    target_modules: Any = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str | None = None) -> AdapterConfig:
        """The config of a PEFT LoRA adapter (``peft_type`` LORA), checked."""
        kind = d.get("peft_type", "LORA")
        if kind != "LORA":
            raise UnsupportedError(
                f"adapter type {shown(kind)}: only LoRA adapters are read as LoRA", path=path
            )
        r: Any = d.get("r")
        alpha: Any = d.get("lora_alpha")
        if not _is_int(r) or r <= 0:
            raise FormatError(f"adapter config r={shown(r)}: not a positive integer", path=path)
        if not _is_number(alpha):
            raise FormatError(f"adapter config lora_alpha={shown(alpha)}: not a number", path=path)
        ranks, alphas = d.get("rank_pattern") or {}, d.get("alpha_pattern") or {}
        if not isinstance(ranks, dict) or not all(_is_int(v) and v > 0 for v in ranks.values()):
            raise FormatError("adapter config rank_pattern: not {module: rank > 0}", path=path)
        if not isinstance(alphas, dict) or not all(map(_is_number, alphas.values())):
            raise FormatError("adapter config alpha_pattern: not {module: alpha}", path=path)
        return cls(
            r=int(r), lora_alpha=float(alpha), use_rslora=bool(d.get("use_rslora")),
            fan_in_fan_out=bool(d.get("fan_in_fan_out")), use_dora=bool(d.get("use_dora")),
            target_modules=d.get("target_modules"), rank_pattern=dict(ranks),
            alpha_pattern=dict(alphas),
        )  # fmt: skip

    def rank(self, module: str) -> int:
        """``r`` of one module (``rank_pattern`` first)."""
        key = _pattern_key(self.rank_pattern, module)
        return self.r if key is None else int(self.rank_pattern[key])

    def alpha(self, module: str) -> float:
        """``lora_alpha`` of one module (``alpha_pattern`` first)."""
        key = _pattern_key(self.alpha_pattern, module)
        return self.lora_alpha if key is None else float(self.alpha_pattern[key])

    def scaling(self, module: str) -> float:
        """``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``, of one module."""
        r = self.rank(module)
        return self.alpha(module) / (math.sqrt(r) if self.use_rslora else r)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _pattern_key(table: Mapping[str, Any], module: str) -> str | None:
    """The first key of a rank/alpha pattern that matches the module's dotted path at its end."""
    for key in table:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error:
            raise FormatError(
                f"adapter config pattern {shown(key)} is not a regular expression"
            ) from None
    return None


# -- the adapter --------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One module the adapter changes: its factors' names in the adapter file."""

    module: str
    kind: str  # "linear" or "embedding"
    a: str
    b: str
    magnitude: str | None = None


@dataclass
class Adapter:
    """An open LoRA adapter: its tensors, its config and its targets by module path."""

    tensors: TensorSet
    config: AdapterConfig
    targets: dict[str, Target]
    whole: dict[str, str]  # a tensor saved whole: its module-path name -> its name in the file
    other: list[str]  # factor-like tensors of no known kind (lora_B biases...)

    @property
    def path(self) -> str | None:
        return self.tensors.path

    def factors(self, module: str) -> tuple[np.ndarray, np.ndarray]:
        """``(A, B)`` of one target as stored."""
        t = self.targets[module]
        return self.tensors[t.a].load(), self.tensors[t.b].load()

    def delta(self, module: str) -> tuple[np.ndarray, np.ndarray, str]:
        """The weight one target adds, in float64 and in the base weight's layout; the
        matching ``scaling * |B| @ |A|`` (for the rounding bound); the product's dtype."""
        t = self.targets[module]
        a, b = self.factors(module)
        rank = self.config.rank(module)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise FormatError(
                f"target {shown(module)}: factors A{list(a.shape)} B{list(b.shape)} do not "
                f"fit rank {rank} of the adapter config",
                path=self.path,
            )
        group = FactorGroup.lowrank("{prefix}.B", "{prefix}.A")  # W = B @ A, as stored
        s = self.config.scaling(module)
        prod = group.effective([b, a], where=repr(module)) * s
        size = group.effective([np.abs(b.astype(np.float64)), np.abs(a.astype(np.float64))]) * s
        if t.kind == "embedding" or self.config.fan_in_fan_out:
            prod, size = prod.T, size.T
        return prod, size, _product_dtype(a.dtype, b.dtype)


def _product_dtype(a: np.dtype, b: np.dtype) -> str:
    """The finer of the factors' dtypes (the dtype a merge or a forward forms the product in)."""
    if a == b:
        return str(a)
    return str(a if _nmant(str(a)) >= _nmant(str(b)) else b)


def _finfo(dtype: str) -> Any:
    import ml_dtypes

    return ml_dtypes.finfo(dtype)


def _nmant(dtype: str) -> int:
    return int(_finfo(dtype).nmant)


def unit_roundoff(dtype: str) -> float:
    """``2**-(nmant + 1)``: the largest relative error of one rounding to ``dtype``."""
    return float(2.0 ** -(_nmant(dtype) + 1))


def ulp_of(x: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` at each ``|x|`` (float64 values; subnormal spacing near 0)."""
    fi = _finfo(dtype)
    _, e = np.frexp(np.abs(x))
    return np.ldexp(1.0, np.maximum(e - 1, int(fi.minexp)) - int(fi.nmant))


def _config_of(ts: TensorSet, path: str | None) -> AdapterConfig:
    """The adapter config of an open set: its folder's, its metadata's, or the file beside it."""
    text = ts.metadata.get(ADAPTER_CONFIG)
    if text is not None:
        return AdapterConfig.from_dict(json.loads(text), path=path)
    if path is not None and os.path.isfile(path):
        beside = os.path.join(os.path.dirname(path) or ".", ADAPTER_CONFIG)
        if os.path.isfile(beside):
            from dmlib.io.hf_pretrained import adapter_config

            return AdapterConfig.from_dict(adapter_config(os.path.dirname(beside) or "."),
                                           path=beside)  # fmt: skip
    raise FormatError(
        f"no {ADAPTER_CONFIG} with it (the scaling lora_alpha / r is unknown): give the "
        "adapter's folder, or its weights file beside its config",
        path=path,
    )


def open_adapter(
    source: Source, stack: contextlib.ExitStack, *, config: Mapping[str, Any] | None = None
) -> Adapter:
    """An adapter from a PEFT folder, a weights file beside its ``adapter_config.json``, or
    an open set (``config=``: the config as a dict instead of the file's); closed with ``stack``."""
    ts = open_source(source, stack)
    path = ts.path
    cfg = AdapterConfig.from_dict(config, path=path) if config else _config_of(ts, path)
    targets, whole, other = _targets(ts)
    if not targets:
        raise TensorNotFoundError(
            f"no LoRA factors (…lora_A.weight / …lora_B.weight) among {len(ts)} tensors, "
            f"e.g. {shown(next(iter(ts), None))}",
            path=path,
        )
    return Adapter(ts, cfg, targets, whole, other)


def module_of(name: str) -> str:
    """A saved name's module path: without ``base_model.model.``, ``.base_layer`` and
    ``.modules_to_save.<adapter>``."""
    name = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
    name = re.sub(r"\.modules_to_save\.[^.]+(?=\.)", "", name)
    return name.replace(".base_layer.", ".")


def _targets(ts: TensorSet) -> tuple[dict[str, Target], dict[str, str], list[str]]:
    """Every target's factor names, the tensors saved whole, the parts of no known kind."""
    parts: dict[str, dict[str, str]] = {}
    whole: dict[str, str] = {}
    other: list[str] = []
    for name in ts:
        m = _PART.match(name)
        if m:
            parts.setdefault(module_of(m["module"]), {})[m["part"]] = name
        elif ".lora_" in name:
            other.append(name)
        else:
            whole[module_of(name)] = name
    targets = {}
    for module, have in sorted(parts.items()):
        mag = next((v for k, v in have.items() if k.startswith("lora_magnitude")), None)
        for kind, (pa, pb) in _KINDS.items():
            if pa in have and pb in have:
                targets[module] = Target(module, kind, have[pa], have[pb], mag)
                break
        else:
            raise FormatError(
                f"target {shown(module)}: factors {sorted(have)} are not a LoRA pair "
                "(lora_A + lora_B, or lora_embedding_A + lora_embedding_B)",
                path=ts.path,
            )
    return targets, whole, other


# -- two adapters ---------------------------------------------------------------------------

_COLUMNS = [
    "target", "kind", "shape", "dtype", "r_a", "r_b", "scaling_a", "scaling_b", "rel_fro",
    "max_abs", "max_ulp", "bound_ulp", "n_outside", "factor_n_diff", "status",
]  # fmt: skip


def compare_adapters(a: Source, b: Source, *, raw_parts: bool = True) -> pd.DataFrame:
    """Compare two LoRA adapters by the weight each target adds (module docstring).

    Parameters
    ----------
    a, b
        PEFT adapter folders, adapter weights files beside their ``adapter_config.json``,
        or open sets holding the config in ``metadata["adapter_config.json"]``.
    raw_parts
        Also compare what is not a factor pair (DoRA magnitude vectors, tensors saved
        whole), bit for bit, one row each (``kind`` ``magnitude`` / ``tensor``).

    Returns
    -------
    DataFrame
        One row per target (``target`` is its module path): ``kind`` (``linear``,
        ``embedding``, ``magnitude``, ``tensor``), ``shape`` and ``dtype`` (of the
        product), each side's ``r`` and ``scaling``, ``rel_fro`` (``||dA - dB||_F /
        ||dA||_F``) and ``max_abs`` of the deltas (float64), ``max_ulp`` (the largest
        ``|dA - dB|`` in ULP of ``dtype`` at the element's largest term, ``scaling *
        (|B| @ |A|)_ij``) and ``bound_ulp`` (the largest
        rounding bound, same unit), ``n_outside`` (elements outside the bound),
        ``factor_n_diff`` (factor elements whose bits differ), ``status``:
        ``identical``, ``equal`` (within the rounding of the float64 product),
        ``different``, ``only in a`` / ``only in b``. ``attrs["verdict"]``: an
        :class:`AdapterVerdict`.
    """
    with contextlib.ExitStack() as stack:
        ada, adb = open_adapter(a, stack), open_adapter(b, stack)
        rows = [_target_row(ada, adb, m) for m in sorted(set(ada.targets) | set(adb.targets))]
        if raw_parts:
            rows += _raw_rows(ada, adb)
    df = pd.DataFrame(rows, columns=_COLUMNS)
    df.attrs["verdict"] = AdapterVerdict.of(rows, ada.path, adb.path)
    df.attrs["path_a"], df.attrs["path_b"] = ada.path, adb.path
    return df


def _target_row(ada: Adapter, adb: Adapter, module: str) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(_COLUMNS)
    row["target"] = module
    if module not in ada.targets or module not in adb.targets:
        row.update(status="only in b" if module not in ada.targets else "only in a",
                   kind=(ada.targets.get(module) or adb.targets[module]).kind)  # fmt: skip
        return row
    da, sa, dtype = ada.delta(module)
    db, sb, _ = adb.delta(module)
    ra, rb = ada.config.rank(module), adb.config.rank(module)
    scale_a, scale_b = ada.config.scaling(module), adb.config.scaling(module)
    row.update(kind=ada.targets[module].kind, shape=list(da.shape), dtype=dtype, r_a=ra, r_b=rb,
               scaling_a=scale_a, scaling_b=scale_b)  # fmt: skip
    if da.shape != db.shape:
        row["status"] = "different"
        return row
    fa, fb = ada.factors(module), adb.factors(module)
    same = all(x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
               for x, y in zip(fa, fb, strict=True))  # fmt: skip
    row["factor_n_diff"] = _factor_n_diff(fa, fb)
    with one_thread(), np.errstate(invalid="ignore", divide="ignore"):
        diff = np.abs(da - db)
        bound = gamma(ra + 4) * sa + gamma(rb + 4) * sb
        # ULP at the element's largest term (scaling |B| @ |A| >= |delta|), as for a merge
        ulp = ulp_of(np.maximum(sa, sb), dtype)
        norm = float(np.linalg.norm(da))
        dnorm = float(np.linalg.norm(diff))
        outside = int(np.count_nonzero(~(diff <= bound)))
        row.update(
            rel_fro=(dnorm / norm) if norm else (0.0 if dnorm == 0 else math.inf),
            max_abs=float(diff.max(initial=0.0)),
            max_ulp=float((diff / ulp).max(initial=0.0)),
            bound_ulp=float((bound / ulp).max(initial=0.0)),
            n_outside=outside,
        )
    if same and scale_a == scale_b:
        row["status"] = "identical"
    else:
        row["status"] = "equal" if outside == 0 else "different"
    return row


def _factor_n_diff(fa: tuple[np.ndarray, ...], fb: tuple[np.ndarray, ...]) -> int | None:
    """Factor elements whose bits differ (None when a factor's shape or dtype differs)."""
    n = 0
    for x, y in zip(fa, fb, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return None
        bx = x.view(np.uint8).reshape(x.size, x.itemsize) if x.size else x
        by = y.view(np.uint8).reshape(y.size, y.itemsize) if y.size else y
        n += int(np.count_nonzero((bx != by).any(axis=-1))) if x.size else 0
    return n


def _raw_rows(ada: Adapter, adb: Adapter) -> list[dict[str, Any]]:
    """DoRA magnitude vectors and tensors saved whole, compared bit for bit."""
    from dmlib.kernels.pair import compare_arrays

    def parts(ad: Adapter) -> dict[str, tuple[str, str]]:
        out = {f"{m}.lora_magnitude_vector": ("magnitude", t.magnitude)
               for m, t in ad.targets.items() if t.magnitude}  # fmt: skip
        out.update({n: ("tensor", saved) for n, saved in ad.whole.items()})
        out.update({n: ("tensor", n) for n in ad.other})
        return out

    pa, pb = parts(ada), parts(adb)
    rows = []
    for name in sorted(set(pa) | set(pb)):
        row: dict[str, Any] = dict.fromkeys(_COLUMNS)
        row.update(target=name, kind=(pa.get(name) or pb[name])[0])
        if name not in pa or name not in pb:
            row["status"] = "only in b" if name not in pa else "only in a"
            rows.append(row)
            continue
        x, y = ada.tensors[pa[name][1]].load(), adb.tensors[pb[name][1]].load()
        row.update(shape=list(x.shape), dtype=str(x.dtype))
        if x.shape != y.shape or x.dtype != y.dtype:
            row["status"] = "different"
        else:
            got = compare_arrays(x, y, name=name)
            row.update(rel_fro=got["rel_fro"], max_abs=got["max_abs"] or 0.0,
                       max_ulp=got["max_ulp"], factor_n_diff=got["n_diff"],
                       status="identical" if got["n_diff"] == 0 else "different")  # fmt: skip
        rows.append(row)
    return rows


@dataclass(frozen=True, eq=False)
class AdapterVerdict(Verdict):
    """Two adapters compared by the weights they add. ``bool()``: every target adds an
    equal weight (bit-identical factors, or equal within the rounding of the product) and
    both adapters have the same targets and parts."""

    n_targets: int
    n_identical: int
    n_equal: int
    different: list[str]
    only_in_a: list[str]
    only_in_b: list[str]
    worst_target: str | None
    worst_rel_fro: float | None
    max_ulp: float | None
    bound_ulp: float | None
    dtype: str | None
    path_a: str | None = None
    path_b: str | None = None

    @classmethod
    def of(
        cls, rows: list[dict[str, Any]], path_a: str | None, path_b: str | None
    ) -> AdapterVerdict:
        """The verdict of :func:`compare_adapters`' rows."""
        both = [r for r in rows if r["status"] in ("identical", "equal", "different")]
        worst = max((r for r in both if r["rel_fro"] is not None),
                    key=lambda r: r["rel_fro"], default=None)  # fmt: skip
        ulps = [r["max_ulp"] for r in both if r["max_ulp"] is not None and r["kind"] != "tensor"]
        bounds = [r["bound_ulp"] for r in both if r["bound_ulp"] is not None]
        dtypes = sorted({r["dtype"] for r in both if r["dtype"] and r["bound_ulp"] is not None})
        return cls(
            n_targets=len(rows),
            n_identical=sum(r["status"] == "identical" for r in rows),
            n_equal=sum(r["status"] == "equal" for r in rows),
            different=[r["target"] for r in rows if r["status"] == "different"],
            only_in_a=[r["target"] for r in rows if r["status"] == "only in a"],
            only_in_b=[r["target"] for r in rows if r["status"] == "only in b"],
            worst_target=None if worst is None else worst["target"],
            worst_rel_fro=None if worst is None else float(worst["rel_fro"]),
            max_ulp=max(ulps, default=None),
            bound_ulp=max(bounds, default=None),
            dtype=", ".join(dtypes) or None,
            path_a=path_a,
            path_b=path_b,
        )

    def __bool__(self) -> bool:
        return not (self.different or self.only_in_a or self.only_in_b) and self.n_targets > 0

    def __str__(self) -> str:
        n = self.n_targets
        if self:
            if self.n_identical == n:
                return f"IDENTICAL: every factor and scaling of the {n} targets and parts"
            return (
                f"EQUAL: the {n} targets add equal weights ({self.n_identical} bit-identical, "
                f"{self.n_equal} equal within the rounding of the float64 product: at most "
                f"{cell(self.max_ulp)} ULP of {self.dtype} apart, bound {cell(self.bound_ulp)} ULP)"
            )
        text = f"DIFFERENT: {len(self.different)} of {n} targets add another weight"
        if self.different:
            text += f" ({names_list(self.different, 5)})"
        if self.worst_target is not None:
            text += (f"; worst {shown(self.worst_target)} rel_fro {cell(self.worst_rel_fro)}"
                     f", max {cell(self.max_ulp)} ULP of {self.dtype}")  # fmt: skip
        for side in ("a", "b"):
            only = getattr(self, f"only_in_{side}")
            if only:
                text += f"; only in {side.upper()}: {names_list(only, 5)}"
        return text


# -- a merge ------------------------------------------------------------------------------

_MERGE_COLUMNS = [
    "target", "weight", "dtype", "shape", "r", "scaling", "max_abs", "max_ulp", "bound_ulp",
    "n_outside", "status",
]  # fmt: skip


def base_name(module: str, names: Iterator[str] | list[str], suffix: str = ".weight") -> str:
    """The base model's name of a module's weight: ``<module>.weight``, else the one name
    ending in it once leading components are dropped (module docstring)."""
    have = set(names)
    parts = module.split(".")
    for i in range(len(parts)):
        candidate = ".".join(parts[i:]) + suffix
        if candidate in have:
            return candidate
        ends = [n for n in have if n.endswith("." + candidate)] if i == 0 else []
        if len(ends) == 1:
            return ends[0]
        if len(ends) > 1:
            raise DmlibError(f"module {shown(module)}: several base tensors end in "
                             f"{shown(candidate)}: {names_list(sorted(ends), 3)}")  # fmt: skip
    raise TensorNotFoundError(f"adapter target {shown(module)}: no {shown(module + suffix)} "
                              "(or a shorter path to it) among the base's tensors")  # fmt: skip


def check_merge(merged: Source, base: Source, adapter: Source) -> pd.DataFrame:
    """Whether ``merged`` equals ``base + scaling * B @ A`` for every target of ``adapter``,
    within the rounding of one merge in the merged dtype (module docstring), and every
    tensor the adapter does not touch is bit-identical in merged and base.

    Returns
    -------
    DataFrame
        One row per target: ``target`` (module path), ``weight`` (the base's tensor
        name), ``dtype`` and ``shape`` (merged), ``r``, ``scaling``, ``max_abs``
        (largest ``|merged - E|``), ``max_ulp`` and ``bound_ulp`` (largest error and
        largest bound, in ULP of the merged dtype at the element's largest term),
        ``n_outside``,
        ``status``: ``within``, ``outside``, ``not checked (DoRA)`` or ``shape differs``.
        ``attrs["untouched"]``: the compare summary of every other tensor;
        ``attrs["verdict"]``: a :class:`MergeVerdict`.
    """
    with contextlib.ExitStack() as stack:
        ad = open_adapter(adapter, stack)
        sm, sb = open_source(merged, stack), open_source(base, stack)
        weights = {m: base_name(m, list(sb), ".weight") for m in ad.targets}
        rows = [_merge_row(ad, sm, sb, m, w) for m, w in weights.items()]
        untouched = _untouched(sm, sb, set(weights.values()), ad)
    df = pd.DataFrame(rows, columns=_MERGE_COLUMNS)
    df.attrs["untouched"] = untouched
    df.attrs["verdict"] = MergeVerdict.of(rows, untouched, ad.other)
    return df


def _merge_row(
    ad: Adapter, sm: TensorSet, sb: TensorSet, module: str, weight: str
) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(_MERGE_COLUMNS)
    row.update(target=module, weight=weight, r=ad.config.rank(module),
               scaling=ad.config.scaling(module))  # fmt: skip
    if weight not in sm:
        raise TensorNotFoundError(f"merged model has no {shown(weight)} (target "
                                  f"{shown(module)})", path=sm.path)  # fmt: skip
    if ad.targets[module].magnitude or ad.config.use_dora:
        row["status"] = "not checked (DoRA)"
        return row
    m, w = sm[weight].load(), sb[weight].load()
    delta, size, _ = ad.delta(module)
    row.update(dtype=str(m.dtype), shape=list(m.shape))
    if m.shape != w.shape or m.shape != delta.shape:
        row["status"] = "shape differs"
        return row
    dtype = str(m.dtype)
    u_t = unit_roundoff(dtype)
    u_a = min(u_t, 2.0**-24) if _nmant(dtype) <= 23 else _U64
    r = row["r"]
    with one_thread(), np.errstate(invalid="ignore"):
        m64, w64 = m.astype(np.float64), w.astype(np.float64)
        expected = w64 + delta
        err = np.abs(m64 - expected)
        bound = (1 + 4 * u_t) * ((u_t + 2 * u_a) * np.abs(m64) + u_t * np.abs(delta)
                                 + gamma(r + 3, u_a) * size)  # fmt: skip
        bound += gamma(r + 4) * (np.abs(w64) + size)
        # ULP at the element's largest term: a sum that cancels is no more exact than its terms
        ulp = ulp_of(np.maximum(np.maximum(np.abs(m64), np.abs(w64)), size), dtype)
        outside = int(np.count_nonzero(~(err <= bound)))
        row.update(max_abs=float(err.max(initial=0.0)), max_ulp=float((err / ulp).max(initial=0.0)),
                   bound_ulp=float((bound / ulp).max(initial=0.0)), n_outside=outside,
                   status="within" if outside == 0 else "outside")  # fmt: skip
    return row


def _untouched(sm: TensorSet, sb: TensorSet, targets: set[str], ad: Adapter) -> dict[str, Any]:
    """Every tensor no target changes, compared (dmlib.compare) between merged and base; a
    tensor the adapter saves whole (``modules_to_save``) against the adapter's copy."""
    from dmlib.stats.compare import compare_with, summarize
    from dmlib.stats.options import CompareOptions

    whole = {n: saved for n, saved in ad.whole.items() if n in sm and n not in targets}
    rest = [n for n in sm if n not in targets and n not in whole]
    keep_m = TensorSet({n: sm[n] for n in rest}, path=sm.path)
    keep_b = TensorSet({n: sb[n] for n in sb if n not in targets and n not in whole}, path=sb.path)
    opts = CompareOptions(progress=False, hash="none")
    df = compare_with(keep_m, keep_b, opts)
    s = summarize(df)
    differing = df.loc[df["n_diff"] > 0, "name"].tolist()
    if whole:
        own = TensorSet({n: ad.tensors[saved] for n, saved in whole.items()}, path=ad.path)
        got = compare_with(TensorSet({n: sm[n] for n in whole}, path=sm.path), own, opts)
        differing += got.loc[got["n_diff"] > 0, "name"].tolist()
        differing += [str(m["name"]) for m in got.attrs["mismatched"]]
    return {
        "n_tensors": int(s.n_tensors) + len(whole), "differ": differing,
        "only_in_merged": list(s.only_in_a), "only_in_base": list(s.only_in_b),
        "mismatched": list(s.mismatched), "saved_whole": sorted(whole), "identical": bool(s),
    }  # fmt: skip


@dataclass(frozen=True, eq=False)
class MergeVerdict(Verdict):
    """A merged model against base + adapter. ``bool()``: every target within the bound
    of one merge, nothing unchecked, every other tensor bit-identical to the base's."""

    n_targets: int
    n_within: int
    outside: list[str]
    not_checked: list[str]
    max_ulp: float | None
    bound_ulp: float | None
    dtype: str | None
    n_untouched: int
    untouched_differ: list[str]
    untouched_one_side: list[str]

    @classmethod
    def of(cls, rows: list[dict[str, Any]], untouched: dict[str, Any],
           other: list[str]) -> MergeVerdict:  # fmt: skip
        """The verdict of :func:`check_merge`'s rows and untouched tensors."""
        checked = [r for r in rows if r["status"] in ("within", "outside")]
        return cls(
            n_targets=len(rows),
            n_within=sum(r["status"] == "within" for r in rows),
            outside=[r["target"] for r in rows if r["status"] in ("outside", "shape differs")],
            not_checked=[r["target"] for r in rows if r["status"].startswith("not checked")]
            + list(other),
            max_ulp=max((r["max_ulp"] for r in checked), default=None),
            bound_ulp=max((r["bound_ulp"] for r in checked), default=None),
            dtype=", ".join(sorted({r["dtype"] for r in checked})) or None,
            n_untouched=untouched["n_tensors"],
            untouched_differ=list(untouched["differ"]),
            untouched_one_side=list(untouched["only_in_merged"]) + list(untouched["only_in_base"])
            + list(untouched["mismatched"]),
        )  # fmt: skip

    def __bool__(self) -> bool:
        return (self.n_within == self.n_targets > 0 and not self.untouched_differ
                and not self.untouched_one_side and not self.not_checked)  # fmt: skip

    def __str__(self) -> str:
        if self:
            return (
                f"MERGED CORRECTLY: {self.n_targets} targets equal base + scaling * B @ A within "
                f"one merge's rounding in {self.dtype} (at most {cell(self.max_ulp)} ULP, bound "
                f"{cell(self.bound_ulp)} ULP); {self.n_untouched} untouched tensors bit-identical"
            )
        parts = []
        if self.outside:
            parts.append(f"{len(self.outside)} of {self.n_targets} targets outside one merge's "
                         f"rounding: {names_list(self.outside, 5)}")  # fmt: skip
        if self.not_checked:
            parts.append(f"not checked: {names_list(self.not_checked, 5)}")
        if self.untouched_differ:
            parts.append(f"{len(self.untouched_differ)} tensors the adapter does not touch "
                         f"differ: {names_list(self.untouched_differ, 5)}")  # fmt: skip
        if self.untouched_one_side:
            parts.append(
                f"held by one side or mismatched: {names_list(self.untouched_one_side, 5)}"
            )
        word = "NOT THE MERGE" if self.outside or self.untouched_differ else "NOT ALL CHECKED"
        return f"{word}: " + "; ".join(parts)
