"""reset(): every tier forgets (vLLM's reset_prefix_cache(reset_connector=True) after a weight update)."""

from __future__ import annotations

import asyncio

from cache_helpers import cache_for, config, fill, make_kv


async def test_reset_forgets_cpu_and_disk_also_across_a_restart(tmp_path, device):
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=4, disk_blocks=32, spill="write_through")
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(12))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        for i in range(0, 12, 4):
            await cache.store(keys[i : i + 4], list(range(i, i + 4)))
        while cache.lookup(keys).disk + cache.lookup(keys).cpu < 12 or cache._tasks:  # write-through lands
            await asyncio.sleep(0.01)
        assert cache.lookup(keys).total == 12
        assert await cache.reset() is True
        assert cache.lookup(keys).total == 0
        assert await cache.load(keys, list(range(20, 32))) == 0
        stats = cache.stats()
        assert stats["cpu"]["resident"] == 0 and stats["disk"]["resident"] == 0
        cache.check_invariants()
        # The cache goes on working after a reset: new blocks are stored and served.
        await cache.store(keys[:2], [0, 1])
        assert await cache.load(keys[:2], [40, 41]) == 2
    async with cache_for(kv, cfg) as cache:  # a restart recovers nothing written before the reset
        assert cache.recovered_blocks <= 2
        assert cache.lookup(keys[2:]).total == 0


async def test_reset_refuses_while_a_store_is_in_flight(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=8)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(4))
        gate = asyncio.get_running_loop().create_future()
        store = asyncio.ensure_future(cache.store(keys, [0, 1, 2, 3], after=gate))
        await asyncio.sleep(0)
        assert await cache.reset() is False  # nothing changed: the store goes on
        gate.set_result(None)
        await store
        assert cache.lookup(keys).total == 4
        assert await cache.reset() is True
        assert cache.lookup(keys).total == 0
