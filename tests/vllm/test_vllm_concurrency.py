"""16 concurrent requests with shared prefixes through vLLM's AsyncLLM, served partly by tiered_kv."""

from __future__ import annotations

import pytest
from conftest import CONCURRENT, CONCURRENT_PREFIXES, cache_config, outputs, run_engine

NEEDS_VLLM = True
pytestmark = pytest.mark.slow


def test_sixteen_concurrent_requests_give_identical_outputs(model_dir, baseline, tmp_path):
    steps = [
        {"concurrent": CONCURRENT},  # stores each group's prefix (and races stores of the same keys)
        {"reset": True},
        {"concurrent": CONCURRENT},  # vLLM's cache is empty: the prefixes come from tiered_kv
    ]
    cfg = cache_config(tmp_path / "disk")
    report = run_engine({"model": model_dir, "tiered_kv": cfg, "async": True, "steps": steps,
                           "stats_file": str(tmp_path / "stats.json")}, tmp_path)
    first, second = outputs(report)
    for prompt, out in zip(CONCURRENT, first, strict=True):
        assert out["tokens"] == baseline[tuple(prompt)]
    for prompt, out in zip(CONCURRENT, second, strict=True):
        assert out["tokens"] == baseline[tuple(prompt)]
    prefix_tokens = len(CONCURRENT_PREFIXES[0])
    assert all(out["cached"] >= prefix_tokens for out in second)
    # Each group's prefix comes from tiered_kv at least once; vLLM caches the loaded blocks, so the
    # group's other requests may then hit vLLM's own prefix cache instead.
    assert report["counters"]["loaded_blocks"] >= len(CONCURRENT_PREFIXES) * (prefix_tokens // 32)
    assert report["counters"].get("load_error_blocks", 0) == 0
