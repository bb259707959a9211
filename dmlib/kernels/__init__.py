"""The bottom room: what every comparison streams through, and nothing above it.

- :mod:`dmlib.kernels.ulp`: ULP distance on integer bit patterns, every float dtype
  (``FloatBits``, ``float_bits``, ``ulp_distance``).
- :mod:`dmlib.kernels.stream`: the streaming pass over chunk pairs (the accumulator
  ``Acc``, float and integer chunks, the exact ULP histogram and its k-th value, page
  release, progress); it calls ``_fused`` (``_fused.c``, the optional compiled pass for
  float32/float64 chunks, built by ``setup.py`` where a C compiler is) or its numpy kernels.
- :mod:`dmlib.kernels.pair`: one tensor pair compared chunk by chunk into one row of
  exact statistics (``compare_pair``, ``identical_row``, ``same_bytes``, the row's columns;
  ``compare_arrays``: the same row for two in-memory arrays).
- :mod:`dmlib.kernels.verdict`: what every typed verdict shares (``Verdict``: read-only
  mapping access over ``to_dict()``; ``cell``: a number as a verdict line shows it).

It imports only ``dtypes``, ``errors``, ``hashing`` and ``tensor``; ``engine`` and
``stats`` are built on it (``tests/test_layering.py`` holds the allowed edges).
"""
