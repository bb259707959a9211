"""Divergence statistics: pairs (and sets) of named tensors in, tidy DataFrames out.

- :mod:`dmlib.stats.compare`: :func:`compare` (one row per tensor), :func:`summarize`
  (one verdict), :func:`ulp_long` (the ULP histogram in long form, for plotting).
- :mod:`dmlib.stats.matrix`: :func:`matrix` (every pair of several runs) and
  :func:`verdict` (same-seed pairs against a different-seed control).
- :mod:`dmlib.stats.options`: :class:`CompareOptions`, every comparison setting with its
  default, validated once; the public functions build it from their keywords.
- :mod:`dmlib.stats.verdicts`: :class:`Summary` and :class:`MatrixVerdict`, typed verdicts
  (``bool``: identical, ``str``: the printed verdict, ``to_dict``: the JSON's dict).

The streaming pass and exact statistics they rest on live a room below, in
:mod:`dmlib.kernels` (ULP distances: :mod:`dmlib.kernels.ulp`).
"""
