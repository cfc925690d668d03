# Two entry points for a fresh machine (see README): `make check` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup check test pytest crosshair lint sglang-env sglang23-env vllm-env check-sglang bench \
	wheel-check mooncake-env lmcache-env sglang-lmcache-env

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch's CPU build first, so that resolving `torch>=2.1` never pulls a CUDA build: PyTorch's
# CPU wheel index as an extra index (PyPI's torch for Linux is the CUDA build). Where a local
# wheel of torch 2.13.0 lies on disk (pip's find-links), pip takes it and the index is only
# asked. For a GPU: install the CUDA build of torch into the venv first (README), or set
# TORCH_INDEX=https://download.pytorch.org/whl/cu128; a venv whose torch imports is kept.
# Where that wheel lies on disk it is installed without asking the index at all, then its
# dependencies from the default index: an unreachable extra index costs pip five retries per
# dependency, minutes per venv.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(TORCH_CPU_INDEX)
TORCH_PIN ?= torch==2.13.0
# $(call install_torch,BIN): torch's build into the venv of BIN
install_torch = { $(if $(filter $(TORCH_CPU_INDEX),$(TORCH_INDEX)),{ $(1)/pip install -q --no-deps \
	--no-index $(TORCH_PIN) 2>/dev/null && $(1)/pip install -q $(TORCH_PIN); } ||) \
	$(1)/pip install -q $(TORCH_PIN) --extra-index-url $(TORCH_INDEX); }

# Triton for the in-place copy kernels (hiradix.kernels), whose index math the tests run
# under Triton's interpreter on the CPU; a CUDA build of torch brings its own, kept.
TRITON_PIN ?= triton==3.9.0
$(VENV)/.installed: pyproject.toml setup.py impl/hiradix/_pagebits.c impl/hiradix/_tokens.c | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(call install_torch,$(BIN))
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q $(TRITON_PIN)
	$(BIN)/pip install -q -e '.[test,triton]'
	touch $@

setup: $(VENV)/.installed

check: setup
	$(BIN)/hiradix check

# pytest under coverage.py: branch coverage of impl/ is reported after the tests. The
# whole suite runs on the bookkeeping core the install built (C where a compiler was found,
# hiradix._slots.core); the pool, cache, transfer, regression and conformance tests run a
# second time on the torch one (HIRADIX_CORE=python), the readable version of the same checks.
PYTHON_CORE_TESTS := tests/impl/test_pools.py tests/impl/test_cache.py tests/impl/test_swa_cache.py \
	tests/impl/test_mamba_cache.py \
	tests/impl/test_transfer.py tests/impl/test_regressions.py tests/impl/test_conformance.py
test: setup
	$(BIN)/python -m coverage run -m pytest
	HIRADIX_CORE=python $(BIN)/python -m coverage run --append -m pytest -q $(PYTHON_CORE_TESTS)
	$(BIN)/python -m coverage report --precision=1 | tail -n 30
	$(MAKE) --no-print-directory crosshair lint

pytest: setup
	$(BIN)/python -m pytest

crosshair: setup
	$(BIN)/python tests/crosshair/run.py

lint: setup
	$(BIN)/ruff check model impl tests
	$(BIN)/mypy --strict model/hiradix_model

# SGLang beside hiradix, for `hiradix check --engine sglang*` and `hiradix bench`: 0.5.20
# (HiRadixCache and UnifiedRadixCache) in .venv-sglang, 0.5.23 (UnifiedRadixCache with its
# Python and Rust tree cores) in .venv-sglang23. --no-deps: sglang's own requirements pull a
# CUDA torch; these are what its caches import.
SGL_VENV ?= .venv-sglang
SGL_BIN := $(SGL_VENV)/bin
SGL_DEPS := orjson psutil pybase64 requests packaging msgspec triton pillow starlette pyzmq \
	tqdm pydantic aiohttp transformers==5.12.1 ipython dill compressed-tensors==0.18.0 gguf \
	openai==2.6.1 partial_json_parser xgrammar==0.2.1 apache-tvm-ffi==0.1.11 sentencepiece
SGL23_VENV ?= .venv-sglang23
SGL23_BIN := $(SGL23_VENV)/bin
SGL23_DEPS := orjson psutil pybase64 requests packaging msgspec triton pillow starlette pyzmq \
	tqdm pydantic aiohttp transformers==5.19.0 ipython dill compressed-tensors==0.18.0 gguf \
	openai==2.8.0 partial_json_parser xgrammar==0.2.7 apache-tvm-ffi==0.1.11 \
	sentencepiece==0.2.1 xxhash

# $(call engine_venv,VENV,DEPS,PIP SPEC,IMPORT CHECK)
define engine_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -c "import torch" 2>/dev/null || $(call install_torch,$(1)/bin)
	$(1)/bin/pip install -q numpy $(2)
	$(1)/bin/pip install -q --no-deps $(3)
	$(1)/bin/pip install -q -e '.[test]'
	$(1)/bin/python -c "import site; open(site.getsitepackages()[0] + '/hiradix-torchvision-standin.pth', 'w').write('$(CURDIR)/tests/sglang_env\\n')"
	$(1)/bin/python -c "$(4)"
	touch $(1)/.installed
endef

$(SGL_VENV)/.installed: pyproject.toml
	$(call engine_venv,$(SGL_VENV),$(SGL_DEPS),sglang==0.5.20,import sglang.srt.mem_cache.hiradix_cache)

$(SGL23_VENV)/.installed: pyproject.toml
	$(call engine_venv,$(SGL23_VENV),$(SGL23_DEPS),sglang==0.5.23,import sglang.srt.mem_cache.unified_radix_cache)

sglang23-env: $(SGL23_VENV)/.installed

sglang-env: $(SGL_VENV)/.installed

check-sglang: sglang-env
	$(SGL_BIN)/hiradix check --engine sglang

bench: sglang-env
	$(SGL_BIN)/hiradix bench

# vLLM (VLLM_VERSION) beside hiradix, for `hiradix check --engine vllm` / `vllm-offload`: its
# KVCacheManager and CPU OffloadingManager import on CPU without vllm._C. --no-deps for
# vllm (its requirements pull a CUDA torch) and for xgrammar (it would pull triton); the
# rest are exactly what vllm.v1.core.{block_pool,kv_cache_manager,kv_cache_utils} and
# vllm.v1.kv_offload import, pinned where vllm pins them.
VLLM_VENV ?= .venv-vllm
# The vLLM release checked (the adapters accept 0.33.0 and 0.34.0; `make vllm-env
# VLLM_VERSION=0.33.0 VLLM_VENV=...` builds the older one).
VLLM_VERSION ?= 0.34.0
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_DEPS := numpy packaging regex cachetools psutil py-cpuinfo requests pillow pyzmq msgspec \
	cloudpickle pybase64 cbor2 uvloop urllib3 prometheus_client partial-json-parser \
	'transformers>=5.16.1,<5.21.0' 'fastapi>=0.133.0,<0.137.0' 'aiohttp>=3.14.4' \
	'openai>=2.25.0' openai-harmony 'pydantic>=2.12.0' 'llguidance>=1.7.0,<1.8.0' \
	apache-tvm-ffi==0.1.11
VLLM_IMPORTS := import vllm.v1.core.block_pool, vllm.v1.core.kv_cache_manager, \
	vllm.v1.core.kv_cache_utils, vllm.v1.kv_offload.cpu.manager

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(call install_torch,$(VLLM_BIN))
	$(VLLM_BIN)/pip install -q --no-deps vllm==$(VLLM_VERSION)
	$(VLLM_BIN)/pip install -q $(VLLM_DEPS)
	$(VLLM_BIN)/pip install -q --no-deps xgrammar==0.2.8
	$(VLLM_BIN)/pip install -q -e '.[test]'
	$(VLLM_BIN)/python -c "$(VLLM_IMPORTS)"
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# LMCache 0.5.6 beside hiradix, for tests/engines/test_lmcache.py (issue 31): LMCacheEngine
# with its LocalCPUBackend and LocalDiskBackend on CPU, and its SGLang layerwise connector
# (SGLang itself is not needed: spec/15). --no-deps: lmcache's requirements
# pull CUDA (cupy-cuda13x, cuda-python, cufile-python, nvtx) and cloud clients; these are
# what lmcache.v1.cache_engine and its CPU and disk backends import.
LMC_VENV ?= .venv-lmcache
# Pinned to what resolved on 2026-12-06 under the issue's bounds (numpy<=2.2.6,
# prometheus_client<=0.24.1, transformers>=5.4), so that CI builds the venv it was tested in.
LMC_DEPS := numba==0.68.1 numpy==2.2.6 pyyaml==6.0.4 requests==2.34.2 cachetools==8.0.3 \
	sortedcontainers==2.4.0 prometheus_client==0.24.1 py-cpuinfo==9.0.0 psutil==7.2.2 \
	aiohttp==3.14.5 aiofile==3.12.3 msgspec==0.23.0 pyzmq==27.3.0 transformers==5.25.0 \
	cryptography==51.0.1
LMC_IMPORTS := import lmcache.v1.cache_engine, lmcache.v1.storage_backend.local_cpu_backend, \
	lmcache.v1.storage_backend.local_disk_backend, lmcache.v1.gpu_connector.gpu_connectors, \
	lmcache.integration.sglang.sglang_adapter

$(LMC_VENV)/.installed: pyproject.toml
	$(call engine_venv,$(LMC_VENV),$(LMC_DEPS),lmcache==0.5.6,$(LMC_IMPORTS))

lmcache-env: $(LMC_VENV)/.installed

# SGLang 0.5.20 into the same venv, for `hiradix check --engine sglang-lmcache` (its
# LMCRadixCache over LMCache's tiers, spec/15 15.9): --no-deps, as for sglang-env, with
# what its mem_cache imports (SGL_DEPS). transformers==5.12.1 is SGLang's own pin and
# satisfies LMCache's transformers>=5.4; numpy stays at LMCache's ceiling (<=2.2.6);
# kernels at SGLang's bound (<0.15): LMC_DEPS's transformers brings 0.19, which
# transformers 5.12.1 cannot import (hub_kernels: "Either a revision or a version").
# `make lmcache-env` alone still builds the venv without SGLang.
LMC_BIN := $(LMC_VENV)/bin
SGL_LMC_DEPS := $(SGL_DEPS) numpy==2.2.6 kernels==0.14.1

$(LMC_VENV)/.sglang-installed: $(LMC_VENV)/.installed
	$(LMC_BIN)/pip install -q $(SGL_LMC_DEPS)
	$(LMC_BIN)/pip install -q --no-deps sglang==0.5.20
	$(LMC_BIN)/python -c "$(LMC_IMPORTS), sglang.srt.mem_cache.storage.lmcache.lmc_radix_cache"
	touch $@

sglang-lmcache-env: $(LMC_VENV)/.sglang-installed

# The installed package, outside the source tree: a wheel built from this checkout into a fresh
# venv (torch's CPU build first), then `hiradix check` and the public import from a temp dir.
WHEEL_VENV ?= .venv-wheel
wheel-check: setup
	rm -rf build dist $(WHEEL_VENV)
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(call install_torch,$(WHEEL_VENV)/bin)
	$(WHEEL_VENV)/bin/pip install -q dist/hiradix-*.whl
	cd "$$(mktemp -d)" && $(CURDIR)/$(WHEEL_VENV)/bin/python -c \
	    "import hiradix, hiradix_model; assert 'site-packages' in hiradix.__file__; print('installed: hiradix', hiradix.__version__, 'at', hiradix.__file__)" \
	    && $(CURDIR)/$(WHEEL_VENV)/bin/hiradix check --seconds 10 --seed 0 >check.log; \
	    rc=$$?; grep -E '^hiradix check: ' check.log; exit $$rc

# Mooncake's store client and mooncake_master, for tests/impl/test_storage_mooncake.py (the
# tests start a master on loopback and end it by pid; without the wheel they skip with the
# install line). --no-deps: mooncake.store imports without aiohttp/requests/msgpack. Its
# libraries link libibverbs.so.1 (Debian: apt-get install -y libibverbs1).
MOONCAKE_PIN ?= mooncake-transfer-engine-non-cuda==0.3.13.post1
mooncake-env: setup
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { echo "mooncake-env needs libibverbs.so.1: apt-get install -y libibverbs1"; exit 1; }
	$(BIN)/pip install -q --no-deps $(MOONCAKE_PIN)
