# Two entry points for a fresh machine (see README): `make check` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup check test pytest crosshair lint sglang-env check-sglang bench

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

# SGLang 0.5.20 beside hiradix, for `hiradix check --engine sglang` and `hiradix bench`.
# --no-deps: sglang's own requirements pull a CUDA torch; these are what its caches import.
SGL_VENV ?= .venv-sglang
SGL_BIN := $(SGL_VENV)/bin
SGL_DEPS := orjson psutil pybase64 requests packaging msgspec triton pillow starlette pyzmq \
	tqdm pydantic aiohttp transformers==5.12.1 ipython dill compressed-tensors==0.18.0 gguf \
	openai==2.6.1 partial_json_parser xgrammar==0.2.1 apache-tvm-ffi==0.1.11 sentencepiece

$(SGL_VENV)/.installed: pyproject.toml
	test -x $(SGL_BIN)/python || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_BIN)/python -c "import torch" 2>/dev/null || $(SGL_BIN)/pip install -q torch==2.13.0
	$(SGL_BIN)/pip install -q numpy $(SGL_DEPS)
	$(SGL_BIN)/pip install -q --no-deps sglang==0.5.20
	$(SGL_BIN)/pip install -q -e '.[test]'
	$(SGL_BIN)/python -c "import site; open(site.getsitepackages()[0] + '/hiradix-torchvision-standin.pth', 'w').write('$(CURDIR)/tests/sglang_env\\n')"
	$(SGL_BIN)/python -c "import sglang.srt.mem_cache.hiradix_cache"
	touch $@

sglang-env: $(SGL_VENV)/.installed

check-sglang: sglang-env
	$(SGL_BIN)/hiradix check --engine sglang

bench: sglang-env
	$(SGL_BIN)/hiradix bench
