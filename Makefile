# Two entry points for a fresh machine (see README): `make check` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup check test pytest crosshair lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch's CPU build first, so that resolving `torch>=2.1` never pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

check: setup
	$(BIN)/hiradix check

test: setup
	$(BIN)/python -m pytest
	$(MAKE) --no-print-directory crosshair lint

pytest: setup
	$(BIN)/python -m pytest

crosshair: setup
	$(BIN)/python tests/crosshair/run.py

lint: setup
	$(BIN)/ruff check model impl tests
	$(BIN)/mypy --strict model/hiradix_model
