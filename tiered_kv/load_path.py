"""The load path: pin the leading hits, promote disk hits into CPU slots, then CPU->GPU.

A disk block is read into a freshly reserved CPU slot and verified before it
counts; a failed check ends the leading run there (a miss, never data).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import TieredKVCache, _Op


async def load_body(cache: TieredKVCache, op: _Op, keys: Sequence[bytes], gpu_ids: Sequence[int]) -> int:
    cpu = cache.cpu
    disk = cache.disk
    cpu_pins: list[int] = []  # CPU slots we hold a pin on (released in finally)
    # 1. Pin the leading run synchronously, so nothing we plan to read is evicted.
    plan: list[tuple[bytes, int, bool]] = []  # key, slot, on_disk
    cpu_ready, pin = cpu.ready, cpu.pin
    for key in keys:
        slot = cpu_ready.get(key)
        if slot is not None:
            pin(slot)
            cpu_pins.append(slot)
            plan.append((key, slot, False))
            continue
        if disk is not None and (slot := disk.index.ready.get(key)) is not None:
            disk.index.pin(slot)
            plan.append((key, slot, True))
            continue
        break
    if not plan:
        return 0
    try:
        n = len(plan)
        src_slots = [slot for _, slot, _ in plan]
        if any(on_disk for _, _, on_disk in plan):
            n = await _promote(cache, op, plan, src_slots, cpu_pins)
        if n == 0 or op.cancelled:
            return 0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        handle = cache._engine.submit_load(src_slots[:n], list(gpu_ids[:n]))
        await handle
        bpb = cache.layout.bytes_per_block
        cache.metrics.moved("cpu_to_gpu", n, n * bpb, loop.time() - t0)
        touch = cpu.policy.touch
        for slot in reversed(src_slots[:n]):  # last first: the prefix's head ends most recent
            touch(slot)
        return n
    finally:
        cache.unpin_cpu_many(cpu_pins)


async def _promote(
    cache: TieredKVCache, op: _Op, plan: list[tuple[bytes, int, bool]], src_slots: list[int], cpu_pins: list[int]
) -> int:
    """Read the plan's disk blocks into CPU slots; returns the length of the run that made it."""
    cpu, disk = cache.cpu, cache.disk
    disk_pos = [i for i, (_, _, on_disk) in enumerate(plan) if on_disk]
    cpu_slots: dict[int, int] = {}
    reads: dict[int, asyncio.Task[bool]] = {}
    try:
        for i in disk_pos:
            if op.cancelled:
                break
            key = plan[i][0]
            if key in cpu.ready or key in cpu.pending:
                break  # promoted by a concurrent load meanwhile; keep it simple: stop here
            slot = cpu.reserve(key)
            if slot is None:
                await cache.make_cpu_room(len(disk_pos) - len(cpu_slots))
                if key in cpu.ready or key in cpu.pending:
                    break
                slot = cpu.reserve(key)
                if slot is None:
                    break
            cpu.pin(slot)
            cpu_slots[i] = slot
        for i, slot in cpu_slots.items():
            reads[i] = cache.spawn(disk.read_block(plan[i][0], plan[i][1], cache.slabs.block_parts(slot)))
        if reads:
            await asyncio.wait(list(reads.values()))
    except BaseException:
        for slot in cpu_slots.values():  # no read was started, or the loop is being torn down
            cpu.unpin(slot)
            cpu.abort(slot)
        raise
    finally:
        for i in disk_pos:
            disk.index.unpin(plan[i][1])
    # Decide the run and commit or abort each promotion (all reads have finished).
    run = len(plan)
    for i in disk_pos:
        slot = cpu_slots.get(i)
        task = reads.get(i) if slot is not None else None
        ok = task is not None and not task.cancelled() and task.exception() is None and task.result()
        if slot is None:
            run = min(run, i)
            continue
        cpu_pins.append(slot)
        if ok:
            cpu.commit(slot)
            src_slots[i] = slot
        else:
            cpu_pins.remove(slot)
            cpu.unpin(slot)
            cpu.abort(slot)
            disk.drop_if_unpinned(plan[i][1], plan[i][0])
            run = min(run, i)
    return run
