"""Mappings between two checkpoints whose names and layouts differ (a converted model).

A mapping (``docs/mapping.md``) says which source tensors become which target tensors
and through which layout changes; :func:`dmlib.compare` with ``mapping=`` compares
through it and reports each difference in both coordinate systems, and :func:`suggest`
proposes one from the values alone.

Modules: :mod:`~dmlib.mapping.spec` (the TOML file), :mod:`~dmlib.mapping.transforms`
(the ops), :mod:`~dmlib.mapping.resolve` (rules expanded over names, every name
accounted for), :mod:`~dmlib.mapping.apply` (the comparison), :mod:`~dmlib.mapping.sides`
(several files as one side), :mod:`~dmlib.mapping.suggest` (a mapping from the data).
"""

from __future__ import annotations

from typing import Any

from dmlib.mapping.spec import Mapping, Rule, load_mapping, to_toml

__all__ = ["Mapping", "Rule", "load_mapping", "suggest", "to_toml"]


def suggest(a: Any, b: Any, **kw: Any) -> Any:
    """:func:`dmlib.mapping.suggest.suggest` (imported on first use)."""
    from dmlib.mapping.suggest import suggest as _suggest

    return _suggest(a, b, **kw)
