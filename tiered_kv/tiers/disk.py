"""The disk tier: a DiskStore (bytes at slots) plus the index and policy over its slots.

Faults degrade the tier instead of failing the cache: an ENOSPC or EIO on a
write stops further writes, is logged once and counted, and reads of blocks
already on disk go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from ..config import DiskTierConfig
from ..errors import DiskError
from ..index import TierIndex
from ..layout import KVLayout
from ..metrics import CacheMetrics
from .disk_store import DiskNamespace, DiskStore

log = logging.getLogger(__name__)


class DiskTier:
    def __init__(
        self,
        cfg: DiskTierConfig,
        layout: KVLayout,
        namespace: DiskNamespace,
        policy: str,
        metrics: CacheMetrics,
    ) -> None:
        self.cfg = cfg
        self.num_slots = layout.slots_for(cfg.capacity)
        self.index = TierIndex("disk", self.num_slots, policy)
        self.store = DiskStore(
            cfg.path,
            namespace,
            self.num_slots,
            list(layout.region_block_bytes),
            o_direct=cfg.o_direct,
            allow_symlink=cfg.allow_symlink,
            io_threads=cfg.io_threads,
            fsync=cfg.fsync,
        )
        self.bytes_per_block = layout.bytes_per_block
        self.metrics = metrics
        self.degraded: str | None = None  # the reason, once writes are disabled
        self._write_slots = asyncio.Semaphore(cfg.max_concurrent_spills)
        metrics.track_used_slots("disk", lambda: self.index.used)

    async def open(self) -> int:
        """Open the store and rebuild the index from what it recovered; returns the block count."""
        recovered = await self.store.open()
        self.index.restore([(b.key, b.slot) for b in recovered])
        return len(recovered)

    @property
    def writable(self) -> bool:
        return self.degraded is None

    def holds(self, key: bytes) -> bool:
        return key in self.index.ready or key in self.index.pending

    async def write_block(self, key: bytes, parts: Sequence[memoryview]) -> bool:
        """Write one block (spill). False when it could not be placed; never raises for disk faults.

        Callers run this in a task the cache owns and never cancels, so an
        executor write is never abandoned half-way with its slot reused.
        """
        if not self.writable:
            return False
        if self.holds(key):
            return True
        idx = self.index
        slot = idx.reserve(key)
        if slot is None:
            victims = idx.evict(1)
            if not victims:
                return False
            self._drop(victims[0])
            self.metrics.evicted["disk"].inc()
            slot = idx.reserve(key)
            if slot is None:  # pragma: no cover - evict freed one
                return False
        try:
            async with self._write_slots:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await self.store.write(slot, key, parts)
                self.metrics.moved("cpu_to_disk", 1, self.bytes_per_block, loop.time() - t0)
        except DiskError as exc:
            idx.abort(slot)
            self._degrade(exc)
            return False
        except BaseException:
            idx.abort(slot)
            raise
        idx.commit(slot)
        self.metrics.spills.inc()
        return True

    async def read_block(self, key: bytes, slot: int, parts: Sequence[memoryview]) -> bool:
        """Read a pinned block into ``parts``; a failed check drops it and returns False."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            ok = await self.store.read(slot, key, parts)
        except DiskError as exc:
            log.warning("disk tier: read of slot %d failed (%s); treating it as a miss", slot, exc)
            ok = False
        if ok:
            self.metrics.moved("disk_to_cpu", 1, self.bytes_per_block, loop.time() - t0)
        else:
            self.metrics.corrupted["disk"].inc()
        return ok

    def drop_if_unpinned(self, slot: int, key: bytes) -> None:
        """Forget a block that failed its check, once nobody else is reading it."""
        idx = self.index
        if idx.pins[slot] == 0 and idx.ready.get(key) == slot:
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        self.index.drop(slot)
        self.store.invalidate(slot)

    def _degrade(self, exc: DiskError) -> None:
        if self.degraded is None:
            self.degraded = str(exc)
            self.metrics.degrade["disk"].inc()
            log.error("disk tier degraded, no more writes (serving from CPU and existing disk blocks): %s", exc)

    async def aclose(self) -> None:
        await self.store.aclose()
