"""The optional compiled kernel; everything else is declared in pyproject.toml.

``dmlib.stats._fused`` (dmlib/stats/_fused.c, the float32/float64 comparison pass) is
built where a C compiler is; without one the install goes on and dmlib uses its numpy
kernels (``optional=True``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dmlib.stats._fused",
            ["dmlib/stats/_fused.c"],
            optional=True,
            extra_compile_args=["-O3"],
        )
    ]
)
