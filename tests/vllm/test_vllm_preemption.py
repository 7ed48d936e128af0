"""Preemption with stores in flight: a KV pool so small that vLLM preempts requests mid-prefill.

A preempted request's blocks are freed at once and reused in the same step; its store jobs not yet
sent must never reach a worker and the ones issued must land before the forward pass (the fence).
The second round serves the prompts from tiered_kv: a block stored from reused GPU blocks would
give other tokens than vLLM alone.
"""

from __future__ import annotations

import pytest
from conftest import PREEMPT_PROMPTS, cache_config, outputs, run_engine

NEEDS_VLLM = True
pytestmark = pytest.mark.slow


def test_preemption_with_stores_in_flight_keeps_outputs_identical(model_dir, baseline, tmp_path):
    cfg = cache_config(cpu="16MiB")
    # One block in flight at a time: stores queue up behind each other, so a request preempted a few
    # steps after its prefill still has stores in flight (the case the fence exists for).
    cfg["transfer"]["max_inflight_bytes"] = "32KiB"
    spec = {"model": model_dir, "tiered_kv": cfg, "num_gpu_blocks": 24, "max_model_len": 512,
            "max_num_batched_tokens": 64, "max_num_seqs": 4,
            "steps": [{"generate": PREEMPT_PROMPTS}, {"reset": True}, {"generate": PREEMPT_PROMPTS}]}  # fmt: skip
    report = run_engine(spec, tmp_path)
    first, second = outputs(report)
    counters = report["counters"]
    assert counters.get("fenced_preemptions", 0) >= 1, counters  # a preempted request still had stores in flight
    for prompt, out in zip(PREEMPT_PROMPTS, first, strict=True):
        assert out["tokens"] == baseline[tuple(prompt)]
    for prompt, out in zip(PREEMPT_PROMPTS, second, strict=True):
        assert out["tokens"] == baseline[tuple(prompt)]
    assert counters["loaded_blocks"] >= len(PREEMPT_PROMPTS)  # the second round read what the first stored
