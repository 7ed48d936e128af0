"""TieredKVCache: lookup / load / store over pinned CPU slots and a disk tier.

Every data move is reserve -> transfer -> commit, or abort after the copy has
finished. Each load and store runs as a task the cache owns; the caller awaits
it through ``asyncio.shield``. A caller's cancellation therefore never cuts a
move in half: it sets a flag, the task stops before its next copy starts, and
whatever was reserved is released only once the copies already issued have
landed. Bookkeeping is synchronous on the loop thread, so no locks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .backpressure import ByteBudget
from .capacity import tier_slots
from .config import Config, check_capacities, load_config
from .errors import BlockIdError, CacheClosedError, KeyFormatError, LayoutError
from .identity import disk_namespace, make_keyer
from .ids import check_block_ids
from .index import LookupResult, TierIndex
from .keys import check_keys, key_problem
from .layout import KVLayout
from .load_path import load_body
from .metrics import CacheMetrics
from .store_path import StoreResult, store_body
from .tiers.cpu import CpuSlabs
from .tiers.disk import DiskTier
from .transfer import make_engine

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Op:
    __slots__ = ("cancelled", "idle")

    def __init__(self) -> None:
        self.cancelled = False
        self.idle = False  # True while the move holds nothing and issued no copy: safe to cancel outright


async def finish_uncancelled(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, absorbing our own cancellation meanwhile (the caller re-raises)."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except BaseException:
            break


class TieredKVCache:
    """Async context manager over a bound KVLayout (see layout.KVLayout.from_tensors).

    ``rank``/``world_size`` (or an engine-supplied ``shard_id``) name the engine's
    shard of the KV: each shard has its own keys and its own disk namespace.
    """

    def __init__(
        self,
        config: Config | str | dict | None,
        layout: KVLayout,
        *,
        metrics: CacheMetrics | None = None,
        rank: int = 0,
        world_size: int = 1,
        shard_id: str | None = None,
    ):
        self.config = cfg = load_config(config)
        if not isinstance(layout, KVLayout) or not layout.is_bound:
            raise LayoutError("TieredKVCache needs a layout bound to the KV tensors (KVLayout.from_tensors or bind)")
        check_capacities(cfg, layout.bytes_per_block)
        self.layout = layout
        self.metrics = metrics or CacheMetrics()
        # The geometry check, the keys and the slot counts come from the same functions a
        # scheduler process uses (identity.make_keyer, capacity.tier_slots).
        self.keyer = make_keyer(cfg, layout, rank=rank, world_size=world_size, shard_id=shard_id)
        self._key_bytes = self.keyer.key_bytes
        slots = tier_slots(cfg, layout)
        self.cpu = TierIndex("cpu", slots["cpu"], cfg.eviction.policy)
        self.metrics.track_used_slots("cpu", lambda: self.cpu.used)
        self.disk: DiskTier | None = None  # built by start(), so that a failed start can be retried
        self._disk_ns = disk_namespace(self.keyer, layout) if cfg.tiers.disk.enabled else None
        self._write_through = cfg.tiers.disk.spill_policy == "write_through"
        self._budget = ByteBudget(cfg.transfer.max_inflight_bytes)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.slabs: CpuSlabs | None = None
        self._engine = None
        self._disk_open = False
        self._state = "new"
        self._starting: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self.recovered_blocks = 0

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> TieredKVCache:
        """Allocate the CPU tier, start the copy engine, open the disk tier: all of it or nothing.

        A failure or a cancellation releases everything taken so far; a later
        ``start()`` may try again. ``start()`` after ``aclose()`` raises.
        """
        if self._state == "open":
            return self
        if self._state in ("closing", "closed"):
            raise CacheClosedError(f"start() on a TieredKVCache that is {self._state}; build a new one")
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._open_all())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Opening runs on in an executor; wait for it, then undo it: all or nothing.
            await finish_uncancelled(starting)
            if self._state == "open":
                await finish_uncancelled(asyncio.ensure_future(self._release_all()))
                self._state = "new"
            raise
        finally:
            if self._starting is starting and starting.done():
                self._starting = None
        if self._state != "open":
            raise CacheClosedError(f"TieredKVCache is {self._state} after start()")
        return self

    async def _open_all(self) -> None:
        cfg = self.config.tiers.cpu
        loop = asyncio.get_running_loop()
        self._state = "starting"
        try:
            # Allocating and pinning a large slab takes seconds: keep it off the loop.
            self.slabs = await loop.run_in_executor(
                None, lambda: CpuSlabs(self.layout, self.cpu.num_slots, pin=cfg.pin_memory, pin_chunk=cfg.pin_chunk)
            )
            self._engine = make_engine(self.config.transfer.engine, list(self.layout.regions), self.slabs.regions)
            if self._disk_ns is not None:
                cfg = self.config
                self.disk = DiskTier(cfg.tiers.disk, self.layout, self._disk_ns, cfg.eviction.policy, self.metrics)
                self.recovered_blocks = await self.disk.open()
                self._disk_open = True
        except BaseException:
            await finish_uncancelled(asyncio.ensure_future(self._release_all()))
            self.disk = None
            self._state = "new"
            raise
        self._state = "open"

    async def __aenter__(self) -> TieredKVCache:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drain every in-flight move, then release threads, files and pinned memory. Idempotent.

        The close runs as a task of its own: a cancelled caller leaves it running, and
        a second caller waits for the same task. Slabs are released only after the
        copy engine has drained, never while a copy may still touch them.
        """
        if self._closing is None:
            if self._starting is not None:
                await finish_uncancelled(self._starting)
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._state = "closing"
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._release_all()
        self._state = "closed"

    async def _release_all(self) -> None:
        """Release what start() took, in reverse; each step only after the copies it guards are done."""
        drained = self._engine is None
        try:
            if self._engine is not None:
                await self._engine.aclose()  # waits for every copy first
            drained = True
            if self.disk is not None and self._disk_open:
                self._disk_open = False
                await self.disk.aclose()
        finally:
            if self.slabs is not None and drained:  # never unregister memory a copy may still touch
                self.slabs.release()
                self.slabs = None

    def _check_open(self) -> None:
        if self._state != "open":
            raise CacheClosedError(f"TieredKVCache is {self._state}; use `async with TieredKVCache(...)`")

    # -- control path -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest leading run of resident keys, per tier; no I/O, O(len(keys)).

        Every key it examines is validated (the hits, which were validated when
        stored, and the key that ends the run); KeyFormatError for a bad one.
        """
        self._check_open()
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            check_keys(keys, self._key_bytes)
        cpu_ready = self.cpu.ready
        disk_ready = self.disk.index.ready if self.disk is not None else {}
        n_cpu = n_disk = 0
        in_flight = False
        for key in keys:
            if key in cpu_ready:
                n_cpu += 1
            elif key in disk_ready:
                n_disk += 1
            else:
                if type(key) is not bytes or len(key) != self._key_bytes:
                    raise KeyFormatError(key_problem(key, self._key_bytes, f"keys[{n_cpu + n_disk}]"))
                in_flight = key in self.cpu.pending or (self.disk is not None and key in self.disk.index.pending)
                break
        m = self.metrics
        m.lookups.inc(len(keys))
        m.hit["cpu"].inc(n_cpu)
        m.hit["disk"].inc(n_disk)
        return LookupResult(n_cpu + n_disk, n_cpu, n_disk, in_flight)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark resident keys as used, last first, so a prefix's head is the most recent."""
        self._check_open()
        check_keys(keys, self._key_bytes)
        for key in reversed(keys):
            slot = self.cpu.ready.get(key)
            if slot is not None:
                self.cpu.touch(slot)
            if self.disk is not None and (slot := self.disk.index.ready.get(key)) is not None:
                self.disk.index.touch(slot)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "cpu": {"slots": self.cpu.num_slots, "used": self.cpu.used, "resident": len(self.cpu.ready)},
            "bytes_per_block": self.layout.bytes_per_block,
            "inflight_bytes": self._budget.used,
        }
        if self.disk is not None:
            d = self.disk
            out["disk"] = {
                "slots": d.num_slots,
                "used": d.index.used,
                "resident": len(d.index.ready),
                "degraded": d.degraded,
                "recovered": self.recovered_blocks,
            }
        out["metrics"] = self.metrics.snapshot()
        return out

    # -- data path ----------------------------------------------------------------------
    async def store(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> StoreResult:
        """Copy the GPU blocks of keys not yet resident into CPU slots."""
        ids = self._check_args(keys, gpu_block_ids)
        keys = list(keys)
        return await self._run(lambda op: store_body(self, op, keys, ids), "store")

    async def load(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> int:
        """Load the leading resident keys into the GPU blocks; returns how many were loaded."""
        ids = self._check_args(keys, gpu_block_ids)
        keys = list(keys)
        return await self._run(lambda op: load_body(self, op, keys, ids), "load")

    def _check_args(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> list[int]:
        """Validate a call before anything is reserved; returns the block ids as plain ints."""
        self._check_open()
        check_keys(keys, self._key_bytes)
        ids = check_block_ids(gpu_block_ids, self.layout.num_blocks)
        if len(keys) != len(ids):
            raise BlockIdError(f"{len(keys)} keys but {len(ids)} gpu_block_ids")
        return ids

    async def _run(self, body: Callable[[_Op], Awaitable[T]], op_name: str) -> T:
        """Run a move as a task the cache owns; the caller waits for it, cancelled or not.

        On cancellation the flag stops the move before its next copy, and the caller
        still waits (shielded) until the copies already issued into or out of its
        GPU blocks have landed: the engine reuses those blocks the moment we return.
        """
        op = _Op()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = self.spawn(body(op))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            op.cancelled = True
            if op.idle:  # waiting for budget: nothing reserved, nothing copying
                task.cancel()
            await finish_uncancelled(task)
            raise
        self.metrics.op_latency[op_name].observe(loop.time() - t0)
        return result

    def spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        """Run a move the cache owns: never cancelled, always awaited by aclose()."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Also raised to the awaiting caller, if any; logged for background spills.
            log.debug("tiered_kv task failed: %r", task.exception())

    # -- CPU pins and room ----------------------------------------------------------------
    def unpin_cpu(self, slot: int) -> None:
        self.unpin_cpu_many([slot])

    def unpin_cpu_many(self, slots: list[int]) -> None:
        # An evicted block still being read or spilled stays READY but detached from the
        # policy; the last unpin frees its slot.
        unpin, detached = self.cpu.unpin, self.cpu.detached
        for slot in slots:
            if unpin(slot) == 0 and slot in detached:
                self.cpu.drop(slot)
                self.metrics.evicted["cpu"].inc()

    def _needs_spill(self, key: bytes) -> bool:
        return self.disk is not None and self.disk.writable and not self.disk.holds(key)

    async def make_cpu_room(self, n: int) -> None:
        """Evict up to n CPU blocks; dirty ones are written to disk before their slot frees."""
        victims = self.cpu.evict(min(n, self.cpu.evictable))
        spills = []
        for slot in victims:
            key = self.cpu.slot_key[slot]
            if key is not None and self._needs_spill(key):
                # Still READY and servable while its only copy is written out.
                self.cpu.pin(slot)  # detached by evict(): the last unpin frees it
                spills.append(self.spawn(self.spill(slot, key)))
            else:
                self.cpu.drop(slot)
                self.metrics.evicted["cpu"].inc()
        if spills:
            await asyncio.wait(spills)

    async def spill(self, slot: int, key: bytes) -> None:
        """Write a pinned CPU block to disk, then unpin it (freeing it if it was evicted)."""
        try:
            await self.disk.write_block(key, self.slabs.block_parts(slot))
        finally:
            self.unpin_cpu(slot)

    def check_invariants(self) -> None:
        """Every slot accounted for (tests call this after stress)."""
        self.cpu.check_invariants()
        if self.disk is not None:
            self.disk.index.check_invariants()
