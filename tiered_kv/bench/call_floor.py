"""The floor under a call's cost (call_cost's third figure): the same manager and engine with nothing between.

A store here checks its arguments, plans (``prepare_store``), submits to the engine, awaits the copy and
commits (``complete_store``); a load the same with ``prepare_load`` / ``complete_load``. No runner, task,
dispatcher, byte budget, metrics or progress notice. What the cache's real call costs above this is what its
own layers add: the figure a leaner path through the runners can win back. CPU tier only (a plan with
spills or promotions needs the runners).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..cache_args import check_blocks
from ..errors import TieredKVError
from .stats import gc_paused


async def floor_call(cache: Any, op: str, keys: list[bytes], gpu_block_ids: list[int]) -> int:
    """One call at the floor; returns the blocks it moved."""
    m, engine = cache.manager, cache.engine
    ids = check_blocks(keys, gpu_block_ids, cache.keyer.key_bytes, cache.layout.num_blocks)
    if op == "store":
        plan = m.prepare_store(keys, ids, [])
        if plan.spill is not None or plan.remote_spill is not None:
            raise TieredKVError("bench: the call floor is for the CPU tier alone (this store spills)")
        try:
            await engine.submit_store(plan.gpu_ids, plan.cpu_slots)
        finally:
            m.complete_store(plan, True)
        return len(plan.cpu_slots)
    plan = m.prepare_load(keys, cache._max_promote, exclusive=False)
    n = len(plan)
    try:
        await engine.submit_load(plan.cpu_slots, ids[:n])
    finally:
        m.complete_load(plan, n)
    return n


async def floor_us(cache: Any, op: str, batches: list[list[bytes]], ids: list[list[int]], samples: int = 3) -> float:
    """Median loop-thread CPU us per call at the floor, over ``samples`` passes of ``batches``."""
    per: list[float] = []
    for s in range(samples):
        work = batches[s * len(batches) // samples : (s + 1) * len(batches) // samples]
        with gc_paused():
            t0 = time.thread_time()
            for k, keys in enumerate(work):
                if await floor_call(cache, op, keys, ids[k % len(ids)]) != len(keys):
                    raise TieredKVError(f"bench: a {op} at the floor moved fewer than its {len(keys)} blocks")
            per.append((time.thread_time() - t0) / max(1, len(work)))
    return round(statistics.median(per) * 1e6, 2)
