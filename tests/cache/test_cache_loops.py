"""TieredKVCache runs on the caller's loop, whichever it is: it creates none and installs no policy."""

from __future__ import annotations

import asyncio

import uvloop
from cache_helpers import cache_for, config, fill, holds, make_kv


async def test_the_cache_runs_on_the_callers_loop_and_leaves_it_alone(tmp_path, device, request, monkeypatch):
    loop = asyncio.get_running_loop()
    on_uvloop = isinstance(loop, uvloop.Loop)
    assert on_uvloop == ("uvloop" in request.node.callspec.id)  # the parametrised loop is the one running
    made = []  # loops anybody creates while the cache lives
    for mod in (asyncio, uvloop):
        real = mod.new_event_loop
        monkeypatch.setattr(mod, "new_event_loop", lambda real=real: made.append(real()) or made[-1])
    policy, tasks = asyncio.get_event_loop_policy(), []
    loop.set_task_factory(lambda lp, coro, **kw: tasks.append(asyncio.Task(coro, loop=lp, **kw)) or tasks[-1])
    try:
        kv = make_kv(64, device)
        async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=32)) as cache:
            keys = cache.keyer.keys_for_block_ids(range(12))
            for i, key in enumerate(keys):
                fill(kv, i, key)
            for i in range(0, 12, 4):
                await cache.store(keys[i : i + 4], list(range(i, i + 4)))
            assert cache.lookup(keys[:4]).disk == 4  # spilled: the disk tier's I/O ran
            assert await cache.load(keys[:4], [40, 41, 42, 43]) == 4
            assert all(holds(kv, 40 + i, keys[i]) for i in range(4))
    finally:
        loop.set_task_factory(None)
    assert made == [] and asyncio.get_event_loop_policy() is policy
    names = {t.get_coro().__qualname__ for t in tasks}
    assert any(n.startswith("DiskStore.") for n in names), names  # the disk protocols' tasks, on this loop
    assert all(t.get_loop() is loop for t in tasks)


async def test_every_move_is_timed_below_a_millisecond(device):
    """Durations come from perf_counter: uvloop's loop.time() ticks in whole milliseconds, so a small copy
    timed with it took 0 s (and the bench divided by zero)."""
    kv = make_kv(64, device)
    async with cache_for(kv, config()) as cache:
        keys = cache.keyer.keys_for_block_ids(range(6))
        seconds = []
        for i, key in enumerate(keys):
            fill(kv, i, key)
            await cache.store([key], [i])
            seconds.append(cache.stats()["metrics"]["tiered_kv_transfer_seconds_total{gpu_to_cpu}"])
        assert all(b > a for a, b in zip([0.0, *seconds], seconds, strict=False)), seconds
