"""A store or load on an engine that ends its copies later on its own (CUDA streams, the direct road) starts
its copy within the call and hears of its end from the engine's future: no task and no await per call
(issue 46 item 7), under the same contract as a threaded copy. The direct road over the native fake driver
stands in for the GPU: a test can hold its copy stream."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from cache_helpers import config, fill, holds, make_kv

import tiered_kv as tkv
from tiered_kv.core import core
from tiered_kv.errors import TransferError
from tiered_kv.transfer import Direction
from tiered_kv.transfer.engines.direct import DirectCopyEngine, RawHandle

fake = core.fake_cuda


def direct_cache(kv, cfg):
    layout = tkv.KVLayout.from_tensors(kv, next(iter(kv.values())).shape[0])
    engines: list[DirectCopyEngine] = []

    def factory(slabs):
        engines.append(DirectCopyEngine(list(layout.regions), slabs.regions, driver="fake:13000"))
        return engines[-1]

    return tkv.TieredKVCache(cfg, layout, engine_factory=factory), engines


def filled(cache, kv, n: int) -> list[bytes]:
    """The keys of GPU blocks 0..n-1, each block filled with its key's bytes."""
    keys = cache.keyer.keys_for_block_ids(range(n))
    for i, key in enumerate(keys):
        fill(kv, i, key)
    return keys


async def started(coro):
    """The call as a task, run until it waits on its copy (the fake stream is held)."""
    task = asyncio.ensure_future(coro)
    for _ in range(3):
        await asyncio.sleep(0)
    return task


async def test_a_store_and_a_load_start_within_the_call_and_own_no_task():
    kv = make_kv(64)
    cache, engines = direct_cache(kv, config(cpu_blocks=8))
    async with cache:
        keys = filled(cache, kv, 8)
        store_stream = engines[0].stream_handle(Direction.STORE)
        fake.hold(store_stream)
        try:
            store = await started(cache.store(keys, list(range(8))))
            assert not store.done() and cache.manager.cpu.n_reserved == 8
            owned = list(cache._tasks)  # the caller's future, owned until it lands: no move task
            assert engines[0].inflight == 1 and len(owned) == 1 and not isinstance(owned[0], asyncio.Task)
        finally:
            fake.hold(store_stream, False)
        assert (await store).stored == 8 and cache.manager.cpu.n_ready == 8
        assert await cache.load(keys, list(range(40, 48))) == 8
        assert all(holds(kv, 40 + i, k) for i, k in enumerate(keys))
        assert len(cache._tasks) == 0
        cache.check_invariants()
        assert cache.manager.cpu.pins.sum() == 0 and cache.manager.cpu.n_reserved == 0


async def test_a_cancelled_store_waits_for_its_copy_then_discards_it():
    kv = make_kv(64)
    cache, engines = direct_cache(kv, config(cpu_blocks=8))
    async with cache:
        keys = filled(cache, kv, 4)
        stream = engines[0].stream_handle(Direction.STORE)
        fake.hold(stream)
        try:
            store = await started(cache.store(keys, [0, 1, 2, 3]))
            store.cancel()
            await asyncio.sleep(0.05)
            assert not store.done(), "a cancelled store returned while its copy still reads the GPU blocks"
        finally:
            fake.hold(stream, False)
        with pytest.raises(asyncio.CancelledError):
            await store
        assert cache.lookup(keys).total == 0  # the caller gave up: what it copied is not trusted
        cache.check_invariants()
        assert cache.manager.cpu.n_reserved == 0


async def test_a_failed_copy_fails_the_call_and_keeps_nothing():
    kv = make_kv(64)
    cache, _ = direct_cache(kv, config(cpu_blocks=8))
    async with cache:
        keys = filled(cache, kv, 4)
        fake.fail_batches(1)
        with pytest.raises(TransferError):
            await cache.store(keys, [0, 1, 2, 3])
        assert cache.lookup(keys).total == 0 and cache.manager.cpu.n_reserved == 0
        assert (await cache.store(keys, [0, 1, 2, 3])).stored == 4  # the next one goes on
        fake.fail_batches(1)
        with pytest.raises(TransferError):
            await cache.load(keys, [20, 21, 22, 23])
        assert cache.manager.cpu.pins.sum() == 0 and cache.lookup(keys).total == 4
        cache.check_invariants()


async def test_the_handed_off_copy_waits_for_the_callers_compute():
    # The cache drops ``compute`` for CPU tensors, so the store runner is driven with the fake driver's
    # raw event: the copy must not start before the model's stream reaches it.
    kv = make_kv(64)
    cache, engines = direct_cache(kv, config(cpu_blocks=8))
    model, ready = fake.stream_create(), fake.event_create()
    try:
        async with cache:
            keys = filled(cache, kv, 4)
            fake.hold(model)  # the forward pass has not reached the event yet
            fake.record(ready, model)
            fake.reset_counts()
            store = await started(cache._runners.stores.store(keys, np.arange(4), [], None, RawHandle(ready)))
            assert fake.counts()["wait"] == 1 and not store.done(), "the copy was not ordered after compute"
            await asyncio.sleep(0.02)
            assert not store.done()
            fake.hold(model, False)
            assert (await store).stored == 4
            assert await cache.load(keys, [20, 21, 22, 23]) == 4 and all(holds(kv, 20 + i, k) for i, k in enumerate(keys))
    finally:
        fake.hold(model, False)
        fake.event_destroy(ready)
        fake.stream_destroy(model)
