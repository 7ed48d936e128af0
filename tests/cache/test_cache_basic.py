from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from cache_helpers import cache_for, config, fill, holds, make_kv

import tiered_kv as tkv


def keys_for(cache, ids):
    return cache.keyer.keys_for_block_ids(ids)


async def test_round_trip_is_byte_exact_and_leaves_other_blocks_alone(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config()) as cache:
        keys = keys_for(cache, range(8))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        res = await cache.store(keys, list(range(8)))
        assert res == tkv.StoreResult(stored=8)
        for t in kv.values():
            t.zero_()
        assert cache.lookup(keys) == tkv.LookupResult(total=8, cpu=8)
        targets = [40, 3, 17, 9, 63, 0, 21, 30]
        assert await cache.load(keys, targets) == 8
        for key, gid in zip(keys, targets, strict=True):
            assert holds(kv, gid, key)
        untouched = set(range(64)) - set(targets)
        assert all(int(t[g].sum()) == 0 for t in kv.values() for g in untouched)
        cache.check_invariants()


async def test_lookup_is_a_leading_run_and_stops_at_a_miss(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config()) as cache:
        keys = keys_for(cache, range(6))
        await cache.store([keys[0], keys[1], keys[3]], [0, 1, 3])
        assert cache.lookup(keys) == tkv.LookupResult(total=2, cpu=2)
        assert await cache.load(keys, list(range(6))) == 2
        assert cache.lookup([]) == tkv.LookupResult()


async def test_store_dedupes_resident_keys_and_copies_nothing(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config()) as cache:
        keys = keys_for(cache, range(4))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        await cache.store(keys, [0, 1, 2, 3])
        before = cache.metrics.snapshot()["tiered_kv_bytes_total{gpu_to_cpu}"]
        kv["k"][0].fill_(0xEE)  # if it copied again, the stored bytes would change
        res = await cache.store(keys + keys[:1], [0, 1, 2, 3, 4])
        assert res.stored == 0 and res.deduped == 5
        assert cache.metrics.snapshot()["tiered_kv_bytes_total{gpu_to_cpu}"] == before
        assert await cache.load(keys[:1], [10]) == 1 and holds(kv, 10, keys[0])


async def test_full_tier_evicts_tail_first_and_serves_only_exact_bytes(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:
        a = keys_for(cache, [1, 2, 3, 4])  # request A: head 1, tail 4
        b = keys_for(cache, [10, 11, 12, 13, 14, 15])
        for i, key in enumerate(a + b):
            fill(kv, i, key)
        await cache.store(a, [0, 1, 2, 3])
        await cache.store(b, [4, 5, 6, 7, 8, 9])
        # 10 blocks into 8 slots: A's tail goes first, so A keeps a usable prefix
        assert cache.lookup(a).total == 2
        assert cache.lookup(b).total == 6
        assert cache.stats()["cpu"]["resident"] == 8
        cache.check_invariants()


async def test_store_larger_than_tier_keeps_leading_keys_and_reports_skipped(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config(cpu_blocks=4)) as cache:
        keys = keys_for(cache, range(10))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        # pin all four slots with a concurrent... simpler: a store of 10 into 4 slots
        res = await cache.store(keys, list(range(10)))
        assert res.stored == 4 and res.skipped == 6
        assert cache.lookup(keys).total == 4
        assert await cache.load(keys[:4], [20, 21, 22, 23]) == 4
        assert all(holds(kv, 20 + i, keys[i]) for i in range(4))


async def test_pinned_blocks_are_never_evicted_during_a_load(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config(cpu_blocks=4)) as cache:
        keys = keys_for(cache, range(8))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        await cache.store(keys[:4], [0, 1, 2, 3])
        # Started together: the load pins its four slots before the store plans, so the
        # store finds nothing evictable and waits for the load instead of evicting.
        load = asyncio.ensure_future(cache.load(keys[:4], [30, 31, 32, 33]))
        store = asyncio.ensure_future(cache.store(keys[4:], [4, 5, 6, 7]))
        assert await load == 4  # the store waited for room instead of evicting pinned blocks
        assert all(holds(kv, 30 + i, keys[i]) for i in range(4))
        assert (await store).stored == 4
        assert cache.lookup(keys[4:]).total == 4
        cache.check_invariants()


async def test_arg_errors_and_closed_cache(device):
    kv = make_kv(device=device)
    cache = cache_for(kv, config())
    with pytest.raises(tkv.CacheClosedError):
        await cache.store([b"x" * 32], [0])
    async with cache:
        with pytest.raises(tkv.BlockIdError, match="2 keys but 1"):
            await cache.store([b"a" * 32, b"b" * 32], [0])
        with pytest.raises(tkv.BlockIdError, match="out of range"):
            await cache.load([b"a" * 32], [64])
        with pytest.raises(tkv.BlockIdError, match="duplicates"):
            await cache.store([b"a" * 32, b"b" * 32], [1, 1])
    await cache.aclose()  # idempotent
    with pytest.raises(tkv.CacheClosedError):
        await cache.load([b"a" * 32], [0])


async def test_compute_is_checked_at_the_call_and_orders_the_copies(device):
    import torch

    kv = make_kv(device=device)
    async with cache_for(kv, config()) as cache:
        keys = keys_for(cache, range(4))
        with pytest.raises(tkv.TransferError, match="compute must be None, a torch.cuda.Event or a torch.cuda"
                                                    ".Stream, got str"):  # fmt: skip
            await cache.store(keys, [0, 1, 2, 3], compute="default")
        with pytest.raises(tkv.TransferError, match="got int"):
            await cache.load(keys, [0, 1, 2, 3], compute=0)
        assert cache.lookup(keys).total == 0 and cache.stats()["cpu"]["used"] == 0  # nothing was reserved
        for i, key in enumerate(keys):
            fill(kv, i, key)
        compute = torch.cuda.current_stream() if device == "cuda" else None
        assert (await cache.store(keys, [0, 1, 2, 3], compute=compute)).stored == 4
        for t in kv.values():
            t.zero_()
        if device == "cuda":
            compute = torch.cuda.Event()
            compute.record()
        assert await cache.load(keys, [8, 9, 10, 11], compute=compute) == 4
        assert all(holds(kv, 8 + i, key) for i, key in enumerate(keys))


def test_unbound_layout_and_capacity_below_one_block(device):
    layout = tkv.KVLayout.from_block_bytes([1024], 64)
    with pytest.raises(tkv.LayoutError, match="bound"):
        tkv.TieredKVCache(config(), layout)
    kv = make_kv(device=device)
    bound = tkv.KVLayout.from_tensors(kv, 64)
    cfg = config()
    cfg["model"] = {"bytes_per_block": 512}
    cfg["tiers"]["cpu"]["capacity"] = 600  # fits the config's 512 but not the real 1024-byte layout
    with pytest.raises(tkv.ConfigError, match=r"tiers.cpu.capacity: 600 bytes.*1024"):
        tkv.TieredKVCache(cfg, bound)


async def test_backpressure_bounds_bytes_in_flight(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config(cpu_blocks=64, inflight=4 * 1024)) as cache:
        if hasattr(cache.engine, "inline_bytes"):
            cache.engine.inline_bytes = 0  # every copy goes to the engine's thread: bytes stay in flight a while
        peak = 0
        stop = False

        async def watch():
            nonlocal peak
            while not stop:
                peak = max(peak, cache._budget.used)
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        keys = keys_for(cache, range(48))
        await asyncio.gather(*(cache.store(keys[i : i + 4], list(range(i, i + 4))) for i in range(0, 48, 4)))
        stop = True
        await watcher
        assert 0 < peak <= 4 * 1024
        assert cache.lookup(keys).total == 48


async def test_stats_and_metrics_are_counters(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config()) as cache:
        keys = keys_for(cache, range(4))
        await cache.store(keys, [0, 1, 2, 3])
        cache.lookup(keys)
        cache.lookup(keys[:2] + keys_for(cache, [99]))
        snap = cache.stats()["metrics"]
        assert snap["tiered_kv_lookup_blocks_total"] == 7
        assert snap["tiered_kv_hit_blocks_total{cpu}"] == 6
        assert snap["tiered_kv_blocks_moved_total{gpu_to_cpu}"] == 4
        assert snap["tiered_kv_used_slots{cpu}"] == 4


async def test_a_closed_cache_frees_its_tiers(tmp_path, device):
    # Every TieredKVCache used to leak its tiers (their views pointed back at them: a cycle the GC
    # cannot see through numpy arrays): closed, dropped and collected, nothing of them may be left.
    kv = make_kv(device=device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=16)) as cache:
        ks = keys_for(cache, range(12))
        await cache.store(ks, list(range(12)))
        assert cache.lookup(ks).total > 0
        m = cache.manager
        refs = [weakref.ref(o) for o in (cache, m, m.cpu, m.disk, m.domain)]
    del cache, m
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


async def test_demoted_blocks_are_the_first_to_go_and_a_touch_takes_them_back(device):
    kv = make_kv(device=device)
    async with cache_for(kv, config(cpu_blocks=4)) as cache:
        keys = keys_for(cache, range(6))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        await cache.store(keys[:4], [0, 1, 2, 3])
        assert cache.demote([keys[3], keys[2]]) == 2  # the newest blocks, put first in line
        cache.touch([keys[2]])  # used again: back in its place
        await cache.store(keys[4:5], [4])  # a full tier: one block must go
        assert cache.lookup([keys[3]]).total == 0  # the demoted one, not the oldest (keys[0])
        assert cache.lookup(keys[:3]).total == 3
        assert cache.demote([keys[5]]) == 0  # not held: nothing to demote
        cache.check_invariants()
