"""Typed verdicts of a comparison (:class:`Summary`), of a matrix of runs
(:class:`MatrixVerdict`) and of two Trainer runs step by step (:class:`RunsVerdict`).

Each is a frozen dataclass and a read-only mapping of its ``to_dict()`` (the dict
:func:`dmlib.summarize`, :func:`dmlib.stats.matrix.verdict` and
:func:`dmlib.stats.components.compare_runs` returned before, key for key, so JSON output
is unchanged); ``bool()`` is True only when identical, ``str()`` is
the verdict the command line prints. Names from data are escaped and cut
(:func:`dmlib.textsafe.shown`): a name holding escape codes cannot rewrite the verdict
word a terminal shows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dmlib.kernels.verdict import Verdict
from dmlib.kernels.verdict import cell as fmt
from dmlib.numfmt import general, sci
from dmlib.textsafe import names_list, shown

__all__ = ["MatrixVerdict", "RunsVerdict", "Summary"]


@dataclass(frozen=True, eq=False)
class Summary(Verdict):
    """One verdict over a :func:`dmlib.compare` result (see :func:`dmlib.summarize`).

    True only when ``identical``: every tensor and scalar the sides hold was compared and
    is bit-identical. A tensor or scalar held by one side only, a dtype or shape mismatch,
    a file left unread or an incomplete frame is never identical.
    """

    n_tensors: int
    numel: int
    n_diff: int
    frac_diff: float
    n_tensors_diff: int
    worst_rel_fro: float | None
    worst_rel_fro_name: str | None
    max_ulp: int | None
    max_ulp_name: str | None
    max_abs: float | None
    only_in_a: list[str]
    only_in_b: list[str]
    mismatched: list[str]
    rounded: list[str]
    byte_order_diff: list[str]
    n_not_compared: int
    n_scalars_diff: int
    scalars_only: list[str]
    not_read: list[Any]
    complete: bool
    identical: bool
    # what the printed line quotes beside the counts (not in to_dict): the first
    # differing scalar (name, a, b) and the first rounded tensor's record
    _scalar_example: tuple[str, Any, Any] | None = field(default=None, repr=False)
    _rounded_example: dict[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, values: Any, attrs: dict[str, Any] | None = None) -> Summary:
        """A Summary from its dict (as ``to_dict()`` or JSON gives it) and the compare
        attrs the line quotes (``scalars_diff``, ``rounded``); a Summary is returned as is."""
        if isinstance(values, Summary):
            return values
        attrs = attrs or {}
        diff = attrs.get("scalars_diff") or {}
        k = next(iter(diff), None)
        example = None if k is None else (k, diff[k][0], diff[k][1])
        rounded = attrs.get("rounded") or []
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        return cls(
            **{n: values[n] for n in names},
            _scalar_example=example,
            _rounded_example=rounded[0] if rounded else None,
        )

    def __bool__(self) -> bool:
        return bool(self.identical)

    @property
    def word(self) -> str:
        """``DIFFERENT``, ``NOT ALL COMPARED``, ``IDENTICAL AFTER ROUNDING`` or ``IDENTICAL``."""
        if self.n_tensors_diff or self.n_scalars_diff:
            return "DIFFERENT"
        if self.n_not_compared or self.not_read or self.scalars_only:
            return "NOT ALL COMPARED"
        if self.identical and self.rounded:
            return "IDENTICAL AFTER ROUNDING"
        return "IDENTICAL" if self.identical else "DIFFERENT"

    def _gaps(self) -> str:
        gaps = [
            f"{len(self.only_in_a)} only in A" if self.only_in_a else "",
            f"{len(self.only_in_b)} only in B" if self.only_in_b else "",
            f"{len(self.mismatched)} with different dtype or shape" if self.mismatched else "",
            f"{len(self.scalars_only)} scalars held by one side" if self.scalars_only else "",
        ]
        return ", ".join(g for g in gaps if g) or "none"

    def __str__(self) -> str:
        name = self.worst_rel_fro_name
        text = (
            f"{self.word}: {self.n_tensors_diff} of {self.n_tensors} compared tensors differ; "
            f"not compared: {self._gaps()}; n_diff {self.n_diff} of numel {self.numel} "
            f"(frac_diff {fmt(self.frac_diff)}); worst rel_fro {fmt(self.worst_rel_fro)}"
            f"{'' if name is None else ' (' + shown(name) + ')'}; max_ulp {fmt(self.max_ulp)}"
        )
        return text + self._notes()

    def _notes(self) -> str:
        """The clauses after the counts: a differing scalar, unread files, byte orders, rounding."""
        text = ""
        if self.n_scalars_diff and self._scalar_example is not None:
            k, va, vb = self._scalar_example
            text += (
                f"; {self.n_scalars_diff} scalars differ "
                f"(e.g. {shown(k)}: {shown(repr(va))} vs {shown(repr(vb))})"
            )
        for note in self.not_read or ():
            text += f"; not read: {shown(note)}"
        if self.byte_order_diff:
            text += (
                f"; {len(self.byte_order_diff)} tensors hold equal values stored in another "
                f"byte order (e.g. {shown(self.byte_order_diff[0])}): equal values, not equal bytes"
            )
        if self.rounded and self._rounded_example is not None:
            r = self._rounded_example
            text += (
                f"; {len(self.rounded)} compared after rounding the wider side to the narrower "
                f"dtype (e.g. {shown(r['name'])}: {r['from']} -> {r['to']}, {r['rounding']}; "
                f"ULP in {r['to']})"
            )
        return text


@dataclass(frozen=True, eq=False)
class MatrixVerdict(Verdict):
    """Same-seed pairs against the control (see :func:`dmlib.stats.matrix.verdict`).

    True only when every pair, the control's included, is bit-identical (the command
    line's exit code 0); ``always_identical`` says the same of the same-seed pairs alone.
    """

    control: str | None
    pairs: list[dict[str, Any]]
    same_worst_rel_fro: float | None
    same_max_ulp: int | None
    same_worst_median_ulp: float | None
    same_max_abs: float | None
    control_rel_fro: float | None
    control_max_ulp: int | None
    separation_orders: float | None
    identical_pairs: list[str]
    never_differ: list[str]
    always_identical: bool

    def __bool__(self) -> bool:
        return bool(self.pairs) and all(p["identical"] for p in self.pairs)

    def __str__(self) -> str:
        g = sci
        lines = [
            f"same-seed pairs: worst rel_fro {g(self.same_worst_rel_fro)}, max_ulp "
            f"{g(self.same_max_ulp)} (median_ulp <= {general(self.same_worst_median_ulp)} in "
            f"every tensor), max_abs {g(self.same_max_abs)}"
        ]
        if self.control is not None:
            sep = self.separation_orders
            lines.append(
                f"control {shown(self.control)}: rel_fro {g(self.control_rel_fro)}, max_ulp "
                f"{g(self.control_max_ulp)}; separation {'-' if sep is None else f'{sep:.1f}'} "
                "orders of magnitude"
            )
        lines.append(f"bit-identical pairs: {names_list(self.identical_pairs) or 'none'}")
        lines.append(f"tensors that never differ (same-seed pairs): {len(self.never_differ)}")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class RunsVerdict(Verdict):
    """Two Trainer output folders compared at every shared step (see
    :func:`dmlib.stats.components.compare_runs`, which documents each field).

    True only when ``bit_exact``: the runs share a step, and every component is compared
    and identical at every shared step. Runs sharing no step, or a component left
    uncompared, are never bit-exact.
    """

    steps: list[int]
    only_in_a: list[int]
    only_in_b: list[int]
    by_step: dict[int, list[dict[str, Any]]]
    first_diff: dict[str, int]
    first_step: int | None
    first_components: list[str]
    loss_parts_at: int | None
    bit_exact: bool
    inconclusive: list[str]

    def __bool__(self) -> bool:
        return bool(self.bit_exact)

    @property
    def word(self) -> str:
        """``BIT-EXACT``, ``DIFFERENT`` or ``NOT ALL COMPARED``."""
        if self.bit_exact:
            return "BIT-EXACT"
        return "NOT ALL COMPARED" if self.first_step is None else "DIFFERENT"

    def __str__(self) -> str:
        if self.bit_exact:
            steps = ", ".join(map(str, self.steps))
            return f"BIT-EXACT: every component identical at every shared step ({steps})"
        if self.first_step is None:
            why = (
                f"{names_list(self.inconclusive)} could not be compared"
                if self.inconclusive
                else "the runs share no step"
            )
            return f"NOT ALL COMPARED: nothing compared differs, but {why}"
        return (
            f"DIFFERENT from step {self.first_step}: "
            f"{names_list(self.first_components)} differ there"
        )
