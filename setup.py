"""The optional compiled kernel and the package layout (the notebooks/ folder shipped as
``dmlib.notebooks``); everything else is declared in pyproject.toml.

Two optional compiled modules, each built where a C compiler is (``optional=True``: without
one the install goes on and dmlib takes its Python and numpy paths, which give the same
results): ``dmlib.kernels._fused`` (dmlib/kernels/_fused.c, the comparison's float32/float64
pass) and ``dmlib.localize.capture._capture`` (dmlib/localize/capture/_capture.c, the
capture's digests, strided copy and manifest JSON).
"""

from setuptools import Extension, find_packages, setup

setup(
    # the notebook collection lives at the top of the repository (notebooks/, what a user
    # opens) and ships inside the wheel as dmlib/notebooks/, so `dmlib report` finds it
    # after a plain `pip install` (dmlib.report.runner looks there first)
    packages=[*find_packages(include=["dmlib", "dmlib.*"]), "dmlib.notebooks"],
    package_dir={"dmlib.notebooks": "notebooks"},
    package_data={"dmlib": ["py.typed"], "dmlib.notebooks": ["*.ipynb"]},
    ext_modules=[
        Extension(
            "dmlib.kernels._fused",
            ["dmlib/kernels/_fused.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension(
            "dmlib.localize.capture._capture",
            ["dmlib/localize/capture/_capture.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
    ],
)
