"""dmlib: numerical-reproducibility forensics for machine learning.

Readers turn checkpoint files into named tensors; statistics turn pairs (or sets) of
named tensors into tidy DataFrames; notebooks turn those into report figures.

The public names below are imported lazily so that ``import dmlib`` stays cheap and
never needs an optional dependency (torch) until the function that uses it is called.
"""

from __future__ import annotations

import importlib
from typing import Any

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

__version__ = "0.1.0"

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
    "ulp_distance": "dmlib.stats.ulp",
    "compare": "dmlib.stats.compare",
    "summarize": "dmlib.stats.compare",
    "matrix": "dmlib.stats.matrix",
    "verdict": "dmlib.stats.matrix",
    "ulp_long": "dmlib.stats.compare",
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
    # localisation
    "capture": "dmlib.localize.capture",
    "open_capture": "dmlib.localize.captures",
    "compare_captures": "dmlib.localize.boundaries",
    "repeat_control": "dmlib.localize.boundaries",
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
    *sorted(_LAZY),
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
