"""dmlib: numerical-reproducibility forensics for machine learning.

Readers turn checkpoint files into named tensors; statistics turn pairs (or sets) of
named tensors into tidy DataFrames; notebooks turn those into report figures.

The public names below are imported lazily so that ``import dmlib`` stays cheap and
never needs an optional dependency (torch) until the function that uses it is called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dmlib.errors import (
    CaptureError,
    DmlibError,
    FormatError,
    LayoutError,
    MissingDependencyError,
    TensorNotFoundError,
    TruncatedError,
    UnknownFormatError,
    UnsupportedError,
)

__version__ = "0.1.0"  # the one place: pyproject.toml reads it from here

if TYPE_CHECKING:  # what the lazy table below provides, visible to type checkers and IDEs
    from dmlib.forensics.columns import (
        column_cosines,
        first_divergent_column,
        first_divergent_columns,
        sign_flip_table,
        sign_flips,
    )
    from dmlib.forensics.factors import (
        FactorGroup,
        compare_factors,
        effective_weights,
        factor_matrix,
    )
    from dmlib.forensics.ladder import check_steps, growth_rates, step_ladder
    from dmlib.forensics.lora import check_merge, compare_adapters
    from dmlib.inspect_ import describe
    from dmlib.io import detect_format, load, open_tensors
    from dmlib.io.burnpack import write_burnpack
    from dmlib.io.safetensors import write_safetensors
    from dmlib.kernels.ulp import ulp_distance
    from dmlib.localize.arbitrate import arbitrate
    from dmlib.localize.boundaries import CaptureVerdict, compare_captures, repeat_control
    from dmlib.localize.capture import CaptureOptions, capture
    from dmlib.localize.capture.record import record, recorded
    from dmlib.localize.captures import open_capture
    from dmlib.localize.patch import patch_test
    from dmlib.localize.rates import repeat_rates, repeat_study, wilson_interval
    from dmlib.padding import padding_across_runs, padding_census, padding_summary
    from dmlib.stats.compare import compare, summarize, ulp_long
    from dmlib.stats.group_l2 import group_l2
    from dmlib.stats.logprobs import LogprobVerdict, compare_logprobs, logprob_ladder
    from dmlib.stats.matrix import matrix, verdict
    from dmlib.stats.options import CompareOptions
    from dmlib.stats.verdicts import MatrixVerdict, Summary
    from dmlib.tensor import ArrayTensorSet, Tensor, TensorSet

# public name -> module that defines it
_LAZY: dict[str, str] = {
    # readers and writers (files -> named tensors)
    "open_tensors": "dmlib.io",
    "load": "dmlib.io",
    "detect_format": "dmlib.io",
    "Tensor": "dmlib.tensor",
    "TensorSet": "dmlib.tensor",
    "ArrayTensorSet": "dmlib.tensor",
    "write_burnpack": "dmlib.io.burnpack",
    "write_safetensors": "dmlib.io.safetensors",
    "padding_census": "dmlib.padding",
    "describe": "dmlib.inspect_",
    # divergence statistics
    "ulp_distance": "dmlib.kernels.ulp",
    "compare": "dmlib.stats.compare",
    "summarize": "dmlib.stats.compare",
    "matrix": "dmlib.stats.matrix",
    "verdict": "dmlib.stats.matrix",
    "ulp_long": "dmlib.stats.compare",
    "group_l2": "dmlib.stats.group_l2",
    "CompareOptions": "dmlib.stats.options",
    "Summary": "dmlib.stats.verdicts",
    "MatrixVerdict": "dmlib.stats.verdicts",
    "compare_logprobs": "dmlib.stats.logprobs",
    "logprob_ladder": "dmlib.stats.logprobs",
    "LogprobVerdict": "dmlib.stats.logprobs",
    # structure-aware forensics
    "first_divergent_column": "dmlib.forensics.columns",
    "column_cosines": "dmlib.forensics.columns",
    "sign_flips": "dmlib.forensics.columns",
    "compare_factors": "dmlib.forensics.factors",
    "FactorGroup": "dmlib.forensics.factors",
    "step_ladder": "dmlib.forensics.ladder",
    "check_steps": "dmlib.forensics.ladder",
    "padding_across_runs": "dmlib.padding",
    "padding_summary": "dmlib.padding",
    "effective_weights": "dmlib.forensics.factors",
    "factor_matrix": "dmlib.forensics.factors",
    "first_divergent_columns": "dmlib.forensics.columns",
    "sign_flip_table": "dmlib.forensics.columns",
    "growth_rates": "dmlib.forensics.ladder",
    "compare_adapters": "dmlib.forensics.lora",
    "check_merge": "dmlib.forensics.lora",
    # localisation
    "capture": "dmlib.localize.capture",
    "CaptureOptions": "dmlib.localize.capture",
    "record": "dmlib.localize.capture.record",
    "recorded": "dmlib.localize.capture.record",
    "open_capture": "dmlib.localize.captures",
    "compare_captures": "dmlib.localize.boundaries",
    "CaptureVerdict": "dmlib.localize.boundaries",
    "repeat_control": "dmlib.localize.boundaries",
    "patch_test": "dmlib.localize.patch",
    "arbitrate": "dmlib.localize.arbitrate",
    "repeat_study": "dmlib.localize.rates",
    "repeat_rates": "dmlib.localize.rates",
    "wilson_interval": "dmlib.localize.rates",
}

__all__ = [
    "CaptureError",
    "DmlibError",
    "FormatError",
    "LayoutError",
    "MissingDependencyError",
    "TensorNotFoundError",
    "TruncatedError",
    "UnknownFormatError",
    "UnsupportedError",
    "__version__",
    "ArrayTensorSet",
    "CaptureVerdict",
    "CaptureOptions",
    "CompareOptions",
    "FactorGroup",
    "LogprobVerdict",
    "MatrixVerdict",
    "Summary",
    "Tensor",
    "TensorSet",
    "arbitrate",
    "capture",
    "check_merge",
    "check_steps",
    "column_cosines",
    "compare",
    "compare_adapters",
    "compare_captures",
    "compare_factors",
    "compare_logprobs",
    "describe",
    "detect_format",
    "effective_weights",
    "factor_matrix",
    "first_divergent_column",
    "first_divergent_columns",
    "group_l2",
    "growth_rates",
    "load",
    "logprob_ladder",
    "matrix",
    "open_capture",
    "open_tensors",
    "padding_across_runs",
    "padding_census",
    "padding_summary",
    "patch_test",
    "record",
    "recorded",
    "repeat_control",
    "repeat_rates",
    "repeat_study",
    "sign_flip_table",
    "sign_flips",
    "step_ladder",
    "summarize",
    "ulp_distance",
    "ulp_long",
    "verdict",
    "wilson_interval",
    "write_burnpack",
    "write_safetensors",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dmlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
