"""Mappings between two checkpoints whose names and layouts differ (a converted model).

A mapping (``docs/mapping.md``) says which source tensors become which target tensors
and through which layout changes; :func:`dmlib.compare` with ``mapping=`` compares
through it and reports each difference in both coordinate systems, and :func:`suggest`
proposes one from the values alone.

Modules: :mod:`~dmlib.mapping.spec` (the TOML file), :mod:`~dmlib.mapping.transforms`
(the ops), :mod:`~dmlib.mapping.resolve` (rules expanded over names, every name
accounted for), :mod:`~dmlib.stats.mapped` (the comparison), :mod:`~dmlib.mapping.sides`
(several files as one side), :mod:`~dmlib.mapping.suggest` (a mapping from the data).
"""

from __future__ import annotations

from dmlib.mapping.spec import Mapping, Rule, load_mapping, to_toml
from dmlib.mapping.suggest import Suggestion, suggest

__all__ = ["Mapping", "Rule", "Suggestion", "load_mapping", "suggest", "to_toml"]
