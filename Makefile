# The two commands of the README. Each installs what it needs first (idempotent, fast when done).
PYTHON ?= python3
# torch is pinned so that pip takes the CPU wheel instead of a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install demo lint test test-fast bench

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check "$(TORCH)" -e ".[test]"

demo: install
	ucp demo

# ruff (lint and import order) and mypy (strict on ucp.format and the public API), configured in pyproject.toml.
lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) .ci/typecheck.py

test: lint
	$(PYTHON) -m pytest -q --durations=25

# The unit tier alone: pure tests, no DeepSpeed run, no subprocess training (under 2 minutes).
test-fast: install
	$(PYTHON) -m pytest -q tests/unit

bench: install
	$(PYTHON) -m pip install --quiet --disable-pip-version-check transformers
	$(PYTHON) benchmarks/convert.py
