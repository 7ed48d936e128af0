"""The call path (issue 28, section 2): a store or load whose copy runs inline does not suspend at all;
one that must wait (a threaded copy, a spill) still goes through the task and its cancellation contract."""

from __future__ import annotations

import asyncio
import threading

import pytest
from cache_helpers import cache_for, config, fill, holds, make_kv

from tiered_kv.transfer import Direction


def run_without_suspending(coro):
    """The coroutine's result if it finishes on its first step (no await ever yields), else AssertionError."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the call suspended")


async def test_an_inline_store_and_load_never_suspend(device):
    if device != "cpu":
        pytest.skip("a CUDA copy ends on its stream, later")
    kv = make_kv(64)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(12))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        res = run_without_suspending(cache.store(keys[:8], list(range(8))))
        assert (res.stored, cache.manager.cpu.n_ready, len(cache._tasks)) == (8, 8, 0)
        # A full tier: the store evicts (no disk below: nothing to spill) and still copies inline.
        res = run_without_suspending(cache.store(keys[8:], list(range(8, 12))))
        assert res.stored == 4 and cache.lookup(keys[8:]).total == 4
        assert run_without_suspending(cache.load(keys[8:], [60, 61, 62, 63])) == 4
        assert all(holds(kv, 60 + i, k) for i, k in enumerate(keys[8:]))
        assert run_without_suspending(cache.load(keys[7:8], [59])) == 0  # evicted (the oldest): a miss, at once
        snap = cache.stats()["metrics"]
        assert snap["tiered_kv_blocks_moved_total{gpu_to_cpu}"] == 12 and snap["tiered_kv_blocks_moved_total{cpu_to_gpu}"] == 4
        cache.check_invariants()
        assert cache.manager.cpu.pins.sum() == 0 and cache.manager.cpu.n_reserved == 0


async def test_a_copy_too_large_to_run_inline_goes_to_the_thread_and_lands(device):
    if device != "cpu":
        pytest.skip("host engine only")
    kv = make_kv(64)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:
        cache.engine.inline_bytes = 0
        keys = cache.keyer.keys_for_block_ids(range(4))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        store = asyncio.ensure_future(cache.store(keys, [0, 1, 2, 3]))
        await asyncio.sleep(0)
        assert not store.done() and cache.manager.cpu.n_reserved == 4  # its copy is on the engine's thread
        assert (await store).stored == 4
        assert await cache.load(keys, [10, 11, 12, 13]) == 4
        assert all(holds(kv, 10 + i, k) for i, k in enumerate(keys))
        cache.check_invariants()


async def test_a_store_that_spills_still_waits_for_the_spill(device, tmp_path):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=16)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(8))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        await cache.store(keys[:4], [0, 1, 2, 3])
        coro = cache.store(keys[4:], [4, 5, 6, 7])  # evicts dirty blocks: they go to disk first
        fut = asyncio.ensure_future(coro)
        assert not fut.done()
        assert (await fut).stored == 4
        assert cache.lookup(keys).total == 8  # the spilled blocks are on disk, the new ones in the CPU tier
        cache.check_invariants()


async def test_a_cancelled_threaded_store_waits_for_its_copy_then_discards_it(device):
    if device != "cpu":
        pytest.skip("host engine only")
    kv = make_kv(64)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:
        cache.engine.inline_bytes = 0
        gate = threading.Event()
        cache.engine._executors[Direction.STORE].submit(gate.wait, 10)  # the copy queues behind it
        keys = cache.keyer.keys_for_block_ids(range(4))
        store = asyncio.ensure_future(cache.store(keys, [0, 1, 2, 3]))
        await asyncio.sleep(0)
        store.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not store.done() and cache.manager.cpu.n_reserved == 4  # the caller still waits for its copy
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await store
        assert cache.manager.cpu.n_reserved == 0 and cache.lookup(keys).total == 0  # discarded
        assert not cache._tasks and cache._budget.used == 0
        cache.check_invariants()
