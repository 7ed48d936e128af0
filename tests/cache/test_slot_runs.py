"""Runs of consecutive CPU slots per store plan (one copy per run): what the cache counts, and what the
allocator hands out through a real cache (copy-path-design.md 2.1.5)."""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import cache_for, config, fill, holds, make_kv
from prometheus_client import generate_latest

from tiered_kv.metrics import runs_summary, slot_runs


def keys_for(cache, ids):
    return cache.keyer.keys_for_block_ids(ids)


@pytest.mark.parametrize(
    ("slots", "runs"),
    [([], 0), ([5], 1), ([3, 1, 2], 1), ([0, 2, 4], 3), ([9, 10, 1, 2, 3, 7], 3), ([7, 6, 5, 0], 2)],
)
def test_slot_runs_counts_runs_of_consecutive_slots_in_any_order(slots, runs):
    assert slot_runs(np.array(slots, dtype=np.int64)) == runs


def test_runs_summary_is_exact():
    assert runs_summary({}) == {"calls": 0, "mean": None, "p90": None, "max": None, "blocks_mean": None}
    # 10 plans: 8 of one run, one of 4, one of 9: the 9th smallest (ceil(0.9 * 10)) is 4.
    s = runs_summary({1: 8, 4: 1, 9: 1}, blocks=640)
    assert s == {"calls": 10, "mean": 2.1, "p90": 4, "max": 9, "blocks_mean": 64.0}
    assert runs_summary({2: 1}, blocks=5)["p90"] == 2


async def test_fresh_stores_are_one_run_each_and_evictions_are_counted_too(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config(cpu_blocks=16)) as cache:
        chains = [keys_for(cache, range(10 * c, 10 * c + 4)) for c in range(4)]  # 4 chains of 4 blocks
        for c, keys in enumerate(chains):
            for i, key in enumerate(keys):
                fill(kv, 4 * c + i, key)
            await cache.store(keys, list(range(4 * c, 4 * c + 4)))
        assert cache.metrics.runs_per_call == {1: 4} and cache.metrics.run_blocks == 16
        # Chains 0 and 2 are used again: chains 1 and 3 (slots 4-7 and 12-15) are the LRU victims.
        for c in (0, 2):
            assert await cache.load(chains[c], list(range(40 + 4 * c, 44 + 4 * c))) == 4
        fresh = keys_for(cache, range(100, 108))
        for i, key in enumerate(fresh):
            fill(kv, 20 + i, key)
        assert (await cache.store(fresh, list(range(20, 28)))).stored == 8
        assert cache.metrics.runs_per_call == {1: 4, 2: 1} and cache.metrics.run_blocks == 24
        snap = cache.metrics.snapshot()
        assert snap["tiered_kv_store_slot_runs_count"] == 5 and snap["tiered_kv_store_slot_runs_sum"] == 6
        scraped = generate_latest(cache.metrics.registry).decode()  # cumulative buckets, as Prometheus reads them
        for le, plans in (("1.0", 4), ("2.0", 5), ("64.0", 5), ("+Inf", 5)):
            assert f'tiered_kv_store_slot_runs_bucket{{le="{le}"}} {plans}.0' in scraped
        assert await cache.load(fresh, list(range(50, 58))) == 8
        assert all(holds(kv, 50 + i, key) for i, key in enumerate(fresh))
        cache.check_invariants()
