"""Cancellation and concurrency: slots are never reused before their copy lands, nothing leaks."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch
from cache_helpers import block_bytes, cache_for, config, fill, holds, make_kv

from tiered_kv.transfer import Direction


def slab_holds(cache, slot: int, key: bytes) -> bool:
    return all(
        torch.equal(region[slot], block_bytes(key, region.shape[1])) for region in cache.slabs.regions
    )


@pytest.mark.parametrize(
    ("with_disk", "policy"), [(False, "lru"), (True, "lru"), (True, "window")], ids=["cpu-only", "cpu+disk", "window"]
)
async def test_random_cancellation_during_1000_concurrent_operations(tmp_path, with_disk, policy, device):
    rng = random.Random(1234)
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=12, disk_blocks=24 if with_disk else 0, policy=policy, inflight=8 * 1024)
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(32))
        for i, key in enumerate(keys):
            fill(kv, i, key)  # source blocks 0..31 never change

        async def one_op(i: int) -> None:
            start = rng.randrange(0, 28)
            n = rng.randint(1, 4)
            if rng.random() < 0.5:
                await cache.store(keys[start : start + n], list(range(start, start + n)))
            else:
                targets = rng.sample(range(32, 64), n)
                await cache.load(keys[start : start + n], targets)

        # Start them in a stream and cancel recent ones at random points while they run
        # (copies are fast here, so only a recent task is likely to be mid-flight).
        tasks = []
        for i in range(1000):
            tasks.append(asyncio.ensure_future(one_op(i)))
            if rng.random() < 0.5:
                await asyncio.sleep(0 if rng.random() < 0.8 else 0.0002)
            if rng.random() < 0.3:
                running = [t for t in tasks[-8:] if not t.done()]
                if running:
                    rng.choice(running).cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        assert not errors, errors[:3]
        assert sum(isinstance(r, asyncio.CancelledError) for r in results) > 100
        # Quiesce: the cache's own tasks (shielded bodies, spills) finish by themselves.
        while cache._tasks:
            await asyncio.sleep(0.001)
        cache.check_invariants()
        assert cache._budget.used == 0
        assert cache.manager.cpu.n_reserved == 0
        assert not cache.manager.cpu.pins.any()
        for key, slot in cache.manager.cpu.resident().items():
            assert slab_holds(cache, slot, key)
        # every resident key, on either tier, loads back exact
        loaded = 0
        for key in keys:
            # (a promotion can push another block off a full disk tier, so ask each time)
            if cache.lookup([key]).total == 1:
                assert await cache.load([key], [63]) == 1
                assert holds(kv, 63, key)
                loaded += 1
        assert loaded
        cache.check_invariants()


async def test_cancelled_store_frees_its_slots_only_after_the_copy(device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(cpu_blocks=8)) as cache:
        gate = threading.Event()
        if hasattr(cache.engine, "inline_bytes"):
            # The copy goes to the engine's thread (an inline one has no await to cancel), and waits
            # there behind a gate until the cancel has come: the copy is in flight when it does.
            cache.engine.inline_bytes = 0
            cache.engine._executors[Direction.STORE].submit(gate.wait, 10)
        keys = cache.keyer.keys_for_block_ids(range(8))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        task = asyncio.ensure_future(cache.store(keys, list(range(8))))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        # slots are still reserved until the engine reports the copy done
        while cache._tasks:
            await asyncio.sleep(0.001)
        cache.check_invariants()
        assert cache.manager.cpu.n_reserved == 0
        assert cache.lookup(keys).total == 0  # a cancelled store is discarded, not half-kept
        assert (await cache.store(keys, list(range(8)))).stored == 8


async def test_aclose_drains_in_flight_work(device):
    kv = make_kv(64, device)
    cache = cache_for(kv, config(cpu_blocks=32))
    await cache.start()
    keys = cache.keyer.keys_for_block_ids(range(32))
    for i, key in enumerate(keys):
        fill(kv, i, key)
    pending = [asyncio.ensure_future(cache.store(keys[i : i + 4], list(range(i, i + 4)))) for i in range(0, 32, 4)]
    await asyncio.sleep(0)
    await cache.aclose()
    assert all(t.done() for t in pending)
    assert cache.engine.closed
    await cache.aclose()
