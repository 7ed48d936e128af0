"""The store path: dedupe -> reserve CPU slots -> GPU->CPU copy -> commit (or abort)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import TieredKVCache, _Op


@dataclass(frozen=True)
class StoreResult:
    stored: int = 0  # copied into new CPU slots
    deduped: int = 0  # already resident (or repeated in the call): touched, not copied
    in_flight: int = 0  # another store of the key is still in flight
    skipped: int = 0  # did not fit (the trailing new keys), or the call was cancelled


async def store_body(cache: TieredKVCache, op: _Op, keys: Sequence[bytes], gpu_ids: Sequence[int]) -> StoreResult:
    cpu = cache.cpu
    disk_ready = cache.disk.index.ready if cache.disk is not None else {}
    todo: list[tuple[bytes, int]] = []
    deduped = in_flight = 0
    seen: set[bytes] = set()
    for key, gid in zip(keys, gpu_ids, strict=True):
        if key in seen or key in cpu.ready or key in disk_ready:
            deduped += 1
        elif key in cpu.pending:
            in_flight += 1
        else:
            todo.append((key, gid))
        seen.add(key)
    if not todo:
        cache.touch(keys)
        return StoreResult(0, deduped, in_flight, 0)

    bpb = cache.layout.bytes_per_block
    budget = len(todo) * bpb
    op.idle = True  # nothing reserved yet: a cancel may interrupt the wait for budget outright
    try:
        await cache._budget.acquire(budget)
    finally:
        op.idle = False
    slots: list[int] = []
    reserved: list[tuple[bytes, int]] = []
    try:
        _reserve_into(cache, todo, reserved)
        # Slots freed by our spills can be taken by concurrent stores before we
        # reserve them; each such steal served another store, so retry while
        # room can still be made (bounded: a tier pinned full ends it at once).
        for _ in range(_ROOM_ATTEMPTS):
            if len(reserved) >= len(todo) or op.cancelled or not _room_possible(cache):
                break
            await cache.make_cpu_room(len(todo) - len(reserved))
            _reserve_into(cache, todo, reserved)
        if op.cancelled or not reserved:
            for _, slot in reserved:
                cpu.abort(slot)
            return StoreResult(0, deduped, in_flight, len(todo))
        slots = [slot for _, slot in reserved]
        gids = [gid for (_, gid), _ in zip(todo, reserved, strict=False)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        handle = cache._engine.submit_store(gids, slots)
        try:
            await handle
        except BaseException:
            # The engine only fails a batch once nothing more will land: safe to free.
            for slot in slots:
                cpu.abort(slot)
            raise
        if op.cancelled:
            # The caller gave up: it may already be reusing those GPU blocks, so
            # what we copied cannot be trusted to match the keys. Discard it.
            for slot in slots:
                cpu.abort(slot)
            return StoreResult(0, deduped, in_flight, len(todo))
        cache.metrics.moved("gpu_to_cpu", len(slots), len(slots) * bpb, loop.time() - t0)
        _commit_in_prefix_order(cache, keys, reserved)
        if cache._write_through and cache.disk is not None and cache.disk.writable:
            for key, slot in reserved:
                cpu.pin(slot)
                cache.spawn(cache.spill(slot, key))
        return StoreResult(len(slots), deduped, in_flight, len(todo) - len(slots))
    finally:
        cache._budget.release(budget)
        if len(reserved) < len(todo):
            cache.metrics.skipped.inc(len(todo) - len(reserved))


_ROOM_ATTEMPTS = 8


def _room_possible(cache: TieredKVCache) -> bool:
    return cache.cpu.free_count > 0 or cache.cpu.evictable > 0 or bool(cache.cpu.detached)


def _reserve_into(cache: TieredKVCache, todo: list[tuple[bytes, int]], reserved: list[tuple[bytes, int]]) -> None:
    """Reserve free slots for the next keys in order; stops at the first that cannot be placed."""
    cpu = cache.cpu
    rest = []
    for key, _ in todo[len(reserved) :]:
        if key in cpu.ready or key in cpu.pending:  # raced in while we waited for room
            break
        rest.append(key)
    reserved += zip(rest, cpu.reserve_many(rest), strict=False)


def _commit_in_prefix_order(cache: TieredKVCache, keys: Sequence[bytes], reserved: list[tuple[bytes, int]]) -> None:
    """Commit new blocks and touch old ones, last key first: the prefix's head ends most recent."""
    new = dict(reserved)
    cpu = cache.cpu
    disk = cache.disk.index if cache.disk is not None else None
    for key in reversed(keys):
        slot = new.pop(key, None)
        if slot is not None:
            cpu.commit(slot)
            continue
        resident = cpu.ready.get(key)
        if resident is not None:
            cpu.touch(resident)
        elif disk is not None and (dslot := disk.ready.get(key)) is not None:
            disk.touch(dslot)
