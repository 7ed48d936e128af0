"""Handlers for CPU <-> disk jobs, and the disk tier's degradation.

Each job is one DiskStore batch call: one executor hand-off, one vectored
syscall per run of consecutive disk slots, one journal append per kind.
A fault of a batch (ENOSPC, EIO, a journal that cannot take more records)
degrades the tier: no more writes, one WARNING,
``tiered_kv_degraded_events_total{disk}``; reads of blocks already on disk go
on, and the cache keeps serving from CPU. A block that fails verification on
read is a miss, never data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import DiskError, KeyFormatError, LayoutError
from ...manager import PromoteJob, SpillJob
from ...media import CPU_TO_DISK, DISK_TO_CPU
from ...metrics import CacheMetrics
from ...tier_config import DiskTierConfig
from ...tiers.cpu import CpuSlabs
from ...tiers.disk import DiskNamespace, DiskStore

log = logging.getLogger("tiered_kv.disk")


class DiskIO:
    """Spill (CPU -> disk) and promote (disk -> CPU) batches against one DiskStore."""

    def __init__(
        self, store: DiskStore, slabs: CpuSlabs, metrics: CacheMetrics, on_degrade: Callable[[], None]
    ) -> None:
        self.store = store
        self._slab = slabs.slab_np
        self._metrics = metrics
        self._on_degrade = on_degrade
        self.degraded: str | None = None  # the reason, once writes are disabled

    @classmethod
    async def open(
        cls,
        cfg: DiskTierConfig,
        namespace: DiskNamespace,
        num_slots: int,
        slabs: CpuSlabs,
        metrics: CacheMetrics,
        on_degrade: Callable[[], None],
    ) -> tuple[DiskIO, list]:
        """Open the tier's store (it releases what it took if that fails); returns it and the recovered blocks."""
        store = DiskStore(
            cfg.path,
            namespace,
            num_slots,
            o_direct=cfg.o_direct,
            allow_symlink=cfg.allow_symlink,
            io_threads=cfg.io_threads,
            fsync=cfg.fsync,
            on_drop=lambda cause, n, detail: metrics.drop("disk", cause, n, detail),
        )
        recovered = await store.open()
        return cls(store, slabs, metrics, on_degrade), recovered

    def register(self, dispatcher: Any) -> None:
        """CPU -> disk (spills; the slots dropped for good forgotten, and flushed) and disk -> CPU (promotions)."""
        dispatcher.register(CPU_TO_DISK, self.write, forget=self.invalidate, flush=self.store.flush)
        dispatcher.register(DISK_TO_CPU, self.read)

    @property
    def writable(self) -> bool:
        return self.degraded is None

    async def write(self, job: SpillJob) -> np.ndarray:
        n = len(job)
        if not self.writable:
            return np.zeros(n, dtype=bool)
        try:
            ok = await self.store.write_many(job.disk_slots, job.keys, self._slab, job.cpu_slots)
        except (KeyFormatError, LayoutError) as e:  # the job's arrays, not the disk: nothing was written
            self._metrics.drop("disk", "invalid_batch", n, str(e))
            return np.zeros(n, dtype=bool)
        except Exception as e:  # ENOSPC, EIO, a journal at its bound, anything unexpected: stop writing
            self.degrade(e, n, "write_failed")
            return np.zeros(n, dtype=bool)
        if not ok.all():  # slots that already had a write in flight
            self._metrics.drop("disk", "write_failed", int(np.count_nonzero(~ok)))
        return ok

    async def read(self, job: PromoteJob) -> np.ndarray:
        n = len(job)
        try:
            ok = await self.store.read_many(job.disk_slots, job.keys, self._slab, job.cpu_slots)
        except (KeyFormatError, LayoutError) as e:
            self._metrics.drop("disk", "invalid_batch", n, str(e))
            raise DiskError(f"promotion of {n} blocks refused: {e}") from e
        except Exception as e:  # the device failed a read (EIO): misses now, and no more writes
            self.degrade(e, n, "read_failed")
            # Raised, not a mask of failures: the blocks were not read, which says nothing of their data.
            raise DiskError(f"promotion of {n} blocks failed: {e}") from e
        if not ok.all():
            bad = int(np.count_nonzero(~ok))
            self._metrics.corrupted["disk"].inc(bad)
            self._metrics.drop("disk", "failed_verification", bad)
        return ok

    def invalidate(self, slots: np.ndarray) -> None:
        self.store.invalidate_many(slots)

    def degrade(self, exc: BaseException, dropped: int = 0, cause: str = "write_failed") -> None:
        """Stop writes for good: one WARNING and one event, however many batches fail after the first.

        ``dropped`` blocks of the failing batch are counted under ``cause`` without a second WARNING.
        """
        if dropped:
            self._metrics.dropped.labels("disk", cause).inc(dropped)
        if self.degraded is None:
            self.degraded = str(exc)
            self._metrics.degrade["disk"].inc()
            log.warning(
                "disk tier degraded, no more writes (serving from CPU and existing disk blocks); "
                "%d block(s) of the failing batch dropped: %s",
                dropped,
                exc,
            )
            self._on_degrade()
