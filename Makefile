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

.PHONY: all demo test test-faults lint layout typecheck bench bench-quick install clean

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

# mypy and import-linter find packages by walking folders, and know nothing of
# pyproject's package-dir mapping (tiers/ -> datacache.tiers, loaders/ ->
# datacache.loaders). They check a tree of links laid out as installed.
LAYOUT := build/layout

layout:
	rm -rf $(LAYOUT) && mkdir -p $(LAYOUT)
	cp -as $(CURDIR)/datacache $(LAYOUT)/datacache
	cp -as $(CURDIR)/tiers $(LAYOUT)/datacache/tiers
	cp -as $(CURDIR)/loaders $(LAYOUT)/datacache/loaders
	find $(LAYOUT) -name __pycache__ -prune -exec rm -rf {} +

lint: $(STAMP) layout
	$(BIN)/ruff check datacache tiers loaders tests benchmarks
	cd $(LAYOUT) && PYTHONPATH=. $(CURDIR)/$(BIN)/lint-imports $(CURDIR)/pyproject.toml

typecheck: $(STAMP) layout
	cd $(LAYOUT) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p datacache

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
