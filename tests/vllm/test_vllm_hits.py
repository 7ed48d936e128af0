"""tiered_kv inside a real vLLM engine: cross-request hits and hits from disk under CPU pressure."""

from __future__ import annotations

import pytest
from conftest import BLOCK, FILLERS, PREFIX_TOKENS, PROMPT_A, PROMPT_B, cache_config, outputs, run_engine

NEEDS_VLLM = True
pytestmark = pytest.mark.slow


def test_cross_request_hit_is_served_by_tiered_kv_with_identical_output(model_dir, baseline, tmp_path):
    # B ends the session A began: the hint reaches the cache's release, which frees the session's chain.
    steps = [{"generate": [PROMPT_A], "hints": {"session": "chat-1", "expect_followup": True}}, {"reset": True},
             {"generate": [PROMPT_B], "hints": {"session": "chat-1", "end_session": True}}]  # fmt: skip
    report = run_engine({"model": model_dir, "tiered_kv": cache_config(), "steps": steps, "kv_events": True}, tmp_path)
    (a,), (b,) = outputs(report)
    assert a["cached"] == 0
    # vLLM's own prefix cache was reset, so every cached token of B came from tiered_kv.
    assert b["cached"] >= PREFIX_TOKENS
    assert report["counters"]["loaded_blocks"] == PREFIX_TOKENS // BLOCK
    assert report["counters"].get("load_error_blocks", 0) == 0
    assert a["tokens"] == baseline[tuple(PROMPT_A)]
    assert b["tokens"] == baseline[tuple(PROMPT_B)]
    assert report["counters"]["released_blocks"] >= len(PROMPT_B) // BLOCK
    # take_events told vLLM (for a router) of A's stored blocks, in vLLM's own block hashes: only blocks whose
    # request.block_hashes were booked at store time are translated, so this counts hashes vLLM handed us.
    assert report["counters"]["event_stored_cpu_blocks"] >= PREFIX_TOKENS // BLOCK
    # A hit whose blocks are all in the CPU tier is served in the step it is found: a synchronous load whose
    # job rides in that step's metadata (so its forward reads the blocks in that very step).
    assert report["counters"]["sync_loads"] == 1
    assert report["counters"]["sync_load_jobs_sent"] == report["counters"]["sync_loads"]


def test_pressure_small_cpu_tier_hits_come_from_disk(model_dir, baseline, tmp_path):
    # 8 blocks of 32 KiB in the CPU tier: the fillers push the shared prefix out to disk.
    cfg = cache_config(tmp_path / "disk", cpu="256KiB")
    steps = [{"generate": [PROMPT_A]}, *({"generate": [f]} for f in FILLERS), {"reset": True},
             {"generate": [PROMPT_B]}]  # fmt: skip
    # The in-process engine: scheduler and worker open the one shared segment in one process.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    report = run_engine({"model": model_dir, "tiered_kv": cfg, "steps": steps, "env": env}, tmp_path)
    outs = outputs(report)
    b = outs[-1][0]
    assert b["cached"] >= PREFIX_TOKENS
    assert report["counters"]["loaded_blocks"] >= PREFIX_TOKENS // BLOCK
    metrics = report["stats"]["metrics"]
    disk_hits = sum(v for k, v in metrics.items() if "disk" in k and "hit" in k)
    assert disk_hits >= PREFIX_TOKENS // BLOCK, {k: v for k, v in metrics.items() if "hit" in k}
    assert report["stats"]["cpu"]["slots"] == 8
    for prompt, (out,) in zip([PROMPT_A, *FILLERS, PROMPT_B], outs, strict=True):
        assert out["tokens"] == baseline[tuple(prompt)]


def test_connector_stats_report_interval_deltas_that_vllm_can_sum():
    from collections import Counter

    from tiered_kv.integrations.vllm.connector import TieredKVConnector
    from tiered_kv.integrations.vllm.stats import StatsDelta

    counters: Counter[str] = Counter()
    delta = StatsDelta()
    assert delta.take(counters) is None
    counters.update(loaded_blocks=8, stored_blocks=10)
    first = delta.take(counters)
    counters.update(loaded_blocks=2, load_error_blocks=1)
    second = delta.take(counters)
    assert second.data == {"loaded_blocks": 2, "load_error_blocks": 1}
    total = TieredKVConnector.build_kv_connector_stats().aggregate(first).aggregate(second)
    assert total.reduce() == {"loaded_blocks": 10, "stored_blocks": 10, "load_error_blocks": 1}
    assert not total.is_empty() and TieredKVConnector.build_kv_connector_stats().is_empty()
