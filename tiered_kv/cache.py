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
from .config import Config, check_capacities, load_config
from .errors import CacheClosedError, LayoutError, TransferError
from .index import LookupResult, TierIndex
from .keys import BlockKeyer, KeyNamespace
from .layout import KVLayout
from .load_path import load_body
from .metrics import CacheMetrics
from .store_path import StoreResult, store_body
from .tiers.cpu import CpuSlabs
from .tiers.disk import DiskTier
from .tiers.disk_store import DiskNamespace
from .transfer import make_engine

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Op:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


class TieredKVCache:
    """Async context manager over a bound KVLayout (see layout.KVLayout.from_tensors)."""

    def __init__(self, config: Config | str | dict | None, layout: KVLayout, *, metrics: CacheMetrics | None = None):
        self.config = cfg = load_config(config)
        if not layout.is_bound:
            raise LayoutError("TieredKVCache needs a layout bound to the KV tensors (KVLayout.from_tensors or bind)")
        check_capacities(cfg, layout.bytes_per_block)
        self.layout = layout
        self.metrics = metrics or CacheMetrics()
        self.keyer = BlockKeyer(
            KeyNamespace(cfg.model.model_id, cfg.model.dtype, layout.digest, cfg.model.block_tokens, cfg.keys.tenant_salt),
            cfg.keys.hash,
        )
        self.cpu = TierIndex("cpu", layout.slots_for(cfg.tiers.cpu.capacity), cfg.eviction.policy)
        self.metrics.track_used_slots("cpu", lambda: self.cpu.used)
        self.disk: DiskTier | None = None
        if cfg.tiers.disk.enabled:
            ns = DiskNamespace(
                cfg.model.model_id, cfg.model.dtype, layout.digest, layout.bytes_per_block, self.keyer.key_bytes
            )
            self.disk = DiskTier(cfg.tiers.disk, layout, ns, cfg.eviction.policy, self.metrics)
        self._write_through = cfg.tiers.disk.spill_policy == "write_through"
        self._budget = ByteBudget(cfg.transfer.max_inflight_bytes)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.slabs: CpuSlabs | None = None
        self._engine = None
        self._state = "new"
        self.recovered_blocks = 0

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> TieredKVCache:
        if self._state != "new":
            return self
        cfg = self.config.tiers.cpu
        loop = asyncio.get_running_loop()
        # Allocating and pinning a large slab takes seconds: keep it off the loop.
        self.slabs = await loop.run_in_executor(
            None, lambda: CpuSlabs(self.layout, self.cpu.num_slots, pin=cfg.pin_memory, pin_chunk=cfg.pin_chunk)
        )
        try:
            self._engine = make_engine(self.config.transfer.engine, list(self.layout.regions), self.slabs.regions)
            if self.disk is not None:
                self.recovered_blocks = await self.disk.open()
        except BaseException:
            self.slabs.release()
            raise
        self._state = "open"
        return self

    async def __aenter__(self) -> TieredKVCache:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drain every in-flight move, then release threads, files and pinned memory. Idempotent."""
        if self._state in ("closing", "closed"):
            while self._state == "closing":
                await asyncio.sleep(0.005)
            return
        was_open = self._state == "open"
        self._state = "closing"
        try:
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            if was_open:
                await self._engine.aclose()
                if self.disk is not None:
                    await self.disk.aclose()
        finally:
            if self.slabs is not None:
                self.slabs.release()
            self._state = "closed"

    def _check_open(self) -> None:
        if self._state != "open":
            raise CacheClosedError(f"TieredKVCache is {self._state}; use `async with TieredKVCache(...)`")

    # -- control path -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest leading run of resident keys, per tier; no I/O, O(len(keys))."""
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
                in_flight = key in self.cpu.pending or (self.disk is not None and key in self.disk.index.pending)
                break
        m = self.metrics
        m.lookups.inc(len(keys))
        m.hit["cpu"].inc(n_cpu)
        m.hit["disk"].inc(n_disk)
        return LookupResult(n_cpu + n_disk, n_cpu, n_disk, in_flight)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark resident keys as used, last first, so a prefix's head is the most recent."""
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
        self._check_args(keys, gpu_block_ids)
        return await self._run(lambda op: store_body(self, op, keys, gpu_block_ids), "store")

    async def load(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> int:
        """Load the leading resident keys into the GPU blocks; returns how many were loaded."""
        self._check_args(keys, gpu_block_ids)
        return await self._run(lambda op: load_body(self, op, keys, gpu_block_ids), "load")

    def _check_args(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> None:
        self._check_open()
        if len(keys) != len(gpu_block_ids):
            raise TransferError(f"{len(keys)} keys but {len(gpu_block_ids)} gpu_block_ids")
        if len(set(gpu_block_ids)) != len(gpu_block_ids):
            raise TransferError("gpu_block_ids contains duplicates")
        n = self.layout.num_blocks
        for gid in gpu_block_ids:
            if not 0 <= gid < n:
                raise TransferError(f"gpu block id {gid} is out of range [0, {n})")

    async def _run(self, body: Callable[[_Op], Awaitable[T]], op_name: str) -> T:
        op = _Op()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = self.spawn(body(op))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            op.cancelled = True
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
