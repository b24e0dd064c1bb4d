# The two commands: `make demo` and `make test`. Both create .venv and install
# what they need on a fresh machine. torch is pinned to the CPU wheel on this
# machine's disk and installed first, so that nothing pulls a multi-GB CUDA build;
# constraints.txt pins the rest to known-good versions so pip never backtracks.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CONSTRAINTS := constraints.txt
STAMP := $(VENV)/.installed
PIP_FLAGS := --quiet --disable-pip-version-check --progress-bar off

.PHONY: all demo test test-faults lint typecheck bench bench-quick install clean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml $(CONSTRAINTS)
	$(PIP) install $(PIP_FLAGS) torch==2.13.0
	$(PIP) install $(PIP_FLAGS) -c $(CONSTRAINTS) -e '.[torch,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m datacache.demo

lint: $(STAMP)
	$(BIN)/ruff check datacache tiers loaders tests benchmarks
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -m "not faults" -q

test-faults: $(STAMP)
	$(BIN)/python -m pytest -m faults -q

bench-quick: $(STAMP)
	$(BIN)/python -m benchmarks.run --quick

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
