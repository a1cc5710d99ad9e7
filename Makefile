# flashlib — two commands: `make lab` to learn, `make test` to check everything.
#
#   make lab         create .venv if missing, install flashlib (editable, notebook + test extras), open JupyterLab
#   make test        lint + library tests + TPU compile checks + strict nbval of every notebook (newest jax)
#   make test-colab  the same suite in .venv-colab, pinned to Colab's TPU runtime (python3.13, jax 0.7.2)
#   make test-quick  the inner loop: lint + library tests with smoke-sized searches, no notebooks or TPU compiles
#   make notebooks   regenerate the setup cells and Colab badges, re-execute every notebook in place
#   make colab-bundle  dist/flashlib-colab-<version>.zip: the wheel and data/ to upload to Colab
#   make release-check build sdist + wheel from HEAD, twine check, install in a fresh venv, run notebooks 00 and 05
#   make mutants     mutation testing of every puzzle's checker (cosmic-ray); report in data/mutants/
#
# Works on any Linux machine with Python >= 3.11 and make; no accelerator needed (Pallas kernels run in
# interpret mode on the CPU; the TPU compiler in libtpu checks the kernels ahead of time).

SHELL := bash
.ONESHELL:
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# First interpreter that actually runs (pyenv shims exist for versions that are not selected).
runs = $(firstword $(foreach c,$(1),$(shell $(c) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo $(c))))
PYTHON ?= $(call runs,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3)
COLAB_PYTHON ?= $(call runs,python3.13 $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13))

VENV := .venv
COLAB_VENV := .venv-colab
EXTRAS := .[notebooks,test]
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

# Run JAX on the CPU even though libtpu is installed (it is there to compile for TPU targets), and let
# several processes load libtpu at once.
export JAX_PLATFORMS ?= cpu
export ALLOW_MULTIPLE_LIBTPU_LOAD := 1
export MPLBACKEND := Agg
export PYDEVD_DISABLE_FILE_VALIDATION := 1

NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider
# The suite on every core (pytest-xdist; tests/conftest.py groups what must share a worker), with the 30
# slowest tests and the time by file at the end of the log. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --durations=30
# In the test targets only: XLA compiles the CPU programs without LLVM's expensive passes (the same HLO,
# the same fusions; TPU compiles and static estimates are unaffected). Compiling was ~90% of the time of the
# property searches; tests marked `optimized` compile at the full level, as a learner's laptop does.
TEST_ENV := JAX_DISABLE_MOST_OPTIMIZATIONS=1

.PHONY: help lab test test-colab test-quick lint test-lib test-notebooks notebooks colab-bundle release-check mutants clean

help:
	@sed -n '3,10p' Makefile | sed 's/^# //'

# --no-compile: Python compiles each module to bytecode when it is first imported, not every module of every
# package at install time (most are never imported here).
$(VENV)/.installed: pyproject.toml tests/test-constraints.txt
	@test -n "$(PYTHON)" || { echo "No Python >= 3.11 found; install one (python3.12 preferred)."; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q --no-compile -c tests/test-constraints.txt -e "$(EXTRAS)"
	touch $@

$(COLAB_VENV)/.installed: pyproject.toml tests/colab-constraints.txt tests/test-constraints.txt
	@test -n "$(COLAB_PYTHON)" || { echo "make test-colab needs python3.13 (Colab's); none found."; exit 1; }
	test -d $(COLAB_VENV) || $(COLAB_PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install -q --upgrade pip
	$(COLAB_VENV)/bin/python -m pip install -q --no-compile -c tests/colab-constraints.txt -c tests/test-constraints.txt -e "$(EXTRAS)"
	touch $@

lab: $(VENV)/.installed
	$(VENV)/bin/jupyter lab notebooks/

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check flashlib tests data notebooks

# `make test` = lint, then one pytest run: the library tests (incl. the TPU compile checks, which must
# really compile here: FLASHLIB_REQUIRE_LIBTPU) and strict nbval of every notebook.
test: lint
	$(TEST_ENV) FLASHLIB_REQUIRE_LIBTPU=1 $(VENV)/bin/pytest $(PARALLEL) tests $(NBVAL) $(NOTEBOOKS)

test-colab: $(COLAB_VENV)/.installed
	$(COLAB_VENV)/bin/python -c 'import jax, sys; print("colab mirror: python", sys.version.split()[0], "jax", jax.__version__)'
	$(TEST_ENV) FLASHLIB_REQUIRE_LIBTPU=1 FLASHLIB_COLAB_ROUTE=1 FLASHLIB_SEARCH=smoke $(COLAB_VENV)/bin/pytest $(PARALLEL) tests $(NBVAL) $(NOTEBOOKS)

# Beside make test, never instead: a verdict in a few minutes while editing (CI runs make test).
test-quick: lint
	$(TEST_ENV) FLASHLIB_SEARCH=smoke $(VENV)/bin/pytest $(PARALLEL) -m "not tpu" tests

test-lib: $(VENV)/.installed
	$(TEST_ENV) $(VENV)/bin/pytest $(PARALLEL) tests

# tests/conftest.py named explicitly: without tests/ on the command line pytest does not load it, and then
# xdist scatters a notebook's cells over workers (each cell in a fresh kernel: NameError).
test-notebooks: $(VENV)/.installed
	$(TEST_ENV) $(VENV)/bin/pytest $(PARALLEL) $(NBVAL) tests/conftest.py $(NOTEBOOKS)

notebooks: $(VENV)/.installed
	$(VENV)/bin/python notebooks/make_setup_cells.py
	$(VENV)/bin/python notebooks/make_hint_cells.py
	for nb in $(NOTEBOOKS); do
	  echo "executing $$nb"
	  $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=600 "$$nb"
	done
	$(VENV)/bin/python tests/clean_notebooks.py $(NOTEBOOKS)

# Every mutant of every puzzle's solution, judged by its checker (~30 min on 2 cores; not in CI: the committed
# report is, checked by tests/test_mutants.py, and each survivor that was killed is a case in tests/test_exercises_*).
mutants: $(VENV)/.installed
	$(VENV)/bin/python tests/mutants.py

# Plain Python and pip only: neither target imports flashlib or needs the development environment.
colab-bundle:
	@test -n "$(PYTHON)" || { echo "No Python >= 3.11 found; install one (python3.12 preferred)."; exit 1; }
	$(PYTHON) notebooks/make_colab_bundle.py

release-check:
	@test -n "$(PYTHON)" || { echo "No Python >= 3.11 found; install one (python3.12 preferred)."; exit 1; }
	$(PYTHON) tests/release_check.py

clean:
	rm -rf $(VENV) $(COLAB_VENV) .pytest_cache .ruff_cache .hypothesis dist
