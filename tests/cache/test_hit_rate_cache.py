"""Issue 12 through the facade: a store of resident keys touches them, exclusive loads, continuations,
session release, and waiting for blocks in flight."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from cache_helpers import cache_for, config, fill, holds, make_kv

from tiered_kv import TieredKVError

pytestmark = pytest.mark.asyncio


async def stored(cache, kv, keys, first_id: int, **kw):
    ids = list(range(first_id, first_id + len(keys)))
    for gid, key in zip(ids, keys, strict=True):
        fill(kv, gid, key)
    return await cache.store(keys, ids, **kw)


@contextlib.asynccontextmanager
async def a_then_b(device):
    """A 4-slot CPU tier holding two pairs of blocks, ``a`` stored before ``b``."""
    kv = make_kv(64, device)
    async with cache_for(kv, config(cpu_blocks=4)) as cache:
        a, b = cache.keyer.keys_for_block_ids(range(2)), cache.keyer.keys_for_block_ids(range(10, 12))
        await stored(cache, kv, a, 0)
        await stored(cache, kv, b, 2)
        yield cache, kv, a, b


async def test_a_store_of_resident_keys_only_still_touches_them(device):
    async with a_then_b(device) as (cache, kv, a, b):
        res = await stored(cache, kv, a, 0)  # nothing to copy: a is touched, most recent again
        assert (res.stored, res.deduped) == (0, 2)
        await stored(cache, kv, cache.keyer.keys_for_block_ids(range(20, 22)), 4)  # evicts the oldest: b
        assert cache.lookup(a).total == 2 and cache.lookup(b).total == 0


async def test_an_exclusive_load_leaves_the_cached_copy_first_to_go_and_a_store_back_revives_it(device):
    async with a_then_b(device) as (cache, kv, a, b):
        assert await cache.load(b, [30, 31], exclusive=True) == 2
        assert holds(kv, 30, b[0]) and holds(kv, 31, b[1])
        await stored(cache, kv, cache.keyer.keys_for_block_ids(range(20, 22)), 4)
        assert cache.lookup(b).total == 0 and cache.lookup(a).total == 2  # b went first, though newer
        cache.check_invariants()


async def test_a_continuation_keeps_its_head(device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(cpu_blocks=4)) as cache:
        chain = cache.keyer.keys_for_block_ids(range(7))
        await stored(cache, kv, chain[:3], 0)
        res = await stored(cache, kv, chain[3:], 3, prefix=chain[:3])
        assert (res.stored, res.skipped) == (1, 3)
        assert cache.lookup(chain).total == 4
        assert await cache.load(chain[:4], [40, 41, 42, 43]) == 4
        assert all(holds(kv, 40 + i, chain[i]) for i in range(4))


async def test_release_makes_a_sessions_unshared_blocks_go_first(device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(cpu_blocks=6)) as cache:
        system = cache.keyer.keys_for_block_ids([1, 2])
        s1 = cache.keyer.keys_for_block_ids([1, 2, 3, 4])
        s2 = cache.keyer.keys_for_block_ids([1, 2, 5, 6])
        await stored(cache, kv, s1, 0, session="one")
        await stored(cache, kv, s2[2:], 4, prefix=system, session="two")
        assert cache.release("one") == s1[2:]
        await stored(cache, kv, cache.keyer.keys_for_block_ids(range(100, 102)), 10)
        assert cache.lookup(s2).total == 4 and cache.lookup(s1).total == 2
        with pytest.raises(TieredKVError, match="session"):
            cache.release(["not", "an", "id"])


async def test_lookup_counts_a_spill_in_flight_and_wait_for_returns_once_it_landed(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=2, disk_blocks=8)) as cache:
        a, b = cache.keyer.keys_for_block_ids(range(2)), cache.keyer.keys_for_block_ids(range(10, 12))
        await stored(cache, kv, a, 0)
        task = asyncio.ensure_future(stored(cache, kv, b, 2))  # a is written to disk first
        for _ in range(1000):
            await asyncio.sleep(0)
            if cache.lookup(a).pending or task.done():
                break
        first = cache.lookup(a)
        assert (first.total, first.pending) == (2, 2) and first.in_flight  # on its way: a hit to wait for
        done = await cache.wait_for(a)
        assert (done.total, done.disk, done.pending) == (2, 2, 0)
        await task
        assert await cache.load(a, [20, 21]) == 2 and holds(kv, 20, a[0])


async def test_a_load_waiting_for_a_store_its_own_hook_lets_in_does_not_hang(device):
    """The engine's save (before_copy) releases an announced store of keys the load waits for."""
    kv = make_kv(64, device)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(3))
        for gid, key in enumerate(keys):
            fill(kv, gid, key)
        await cache.store(keys[:1], [0])
        gate = asyncio.Event()
        saving = asyncio.ensure_future(cache.store(keys[1:], [1, 2], after=gate.wait()))
        await asyncio.sleep(0)
        assert cache.lookup(keys).pending == 2  # announced: in flight, not a miss

        async def save() -> None:
            gate.set()
            await saving

        # Nothing of the run is loadable yet: the load waits, after running its hook.
        n = await asyncio.wait_for(cache.load(keys[1:], [11, 12], exclusive=True, before_copy=save), 5)
        assert n == 2 and holds(kv, 11, keys[1]) and holds(kv, 12, keys[2])


async def test_an_exclusive_load_in_chunks_keeps_its_later_chunks_while_the_engine_saves(device):
    """The engine's save after the first chunk must not push out blocks the later chunks load."""
    kv = make_kv(64, device)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:  # staging: 4 rows, so two chunks
        run = cache.keyer.keys_for_block_ids(range(8))
        await stored(cache, kv, run, 0)
        victims = cache.keyer.keys_for_block_ids(range(100, 106))
        for i, key in enumerate(victims):
            fill(kv, 20 + i, key)

        async def save() -> None:  # six blocks the engine's own cache evicts for this request
            await cache.store(victims, list(range(20, 26)))

        n = await cache.load(run, list(range(40, 48)), exclusive=True, before_copy=save)
        assert n == 8 and all(holds(kv, 40 + i, run[i]) for i in range(8))
        cache.check_invariants()
