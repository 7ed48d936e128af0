"""The spill runner: a plan's writes from CPU slots to the tiers below (disk, remote), committed by the manager.

Evicted slots are written back before their new owners' copies (``victims``); write-through
jobs run in the background after a store (``in_background``); a reset forgets what the tiers
below hold (``forget``). Neither raises for a tier's
fault: a disk fault degrades the disk tier (its handler says so), a Redis fault the remote
tier, and the blocks that did not land are dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from ...errors import DiskError, RemoteError
from ...manager import SpillJob, TierManager
from ...media import CPU_TO_DISK
from ...metrics import CacheMetrics
from ...owned_tasks import TaskSet
from ..handlers import DiskIO, Dispatcher
from .control import Progress

log = logging.getLogger(__name__)


class SpillRunner:
    """CPU -> disk and CPU -> remote jobs of the manager's plans (see the module docstring)."""

    def __init__(
        self,
        manager: TierManager,
        dispatcher: Dispatcher,
        metrics: CacheMetrics,
        tasks: TaskSet,
        progress: Progress,
        *,
        disk: DiskIO | None,
        remote: Any = None,
    ) -> None:
        self._m = manager
        self._dispatch = dispatcher
        self._metrics = metrics
        self._tasks = tasks
        self._progress = progress
        self._disk = disk
        self._remote = remote  # handlers.remote_io.RemoteIO, or None

    async def victims(self, spill: SpillJob | None, remote_spill: SpillJob | None) -> None:
        """Write-back of evicted slots, to disk and the remote tier at once, before the slots are reused."""
        writes = []
        if spill is not None:
            writes.append(self.spill(spill))
        if remote_spill is not None:
            writes.append(self.write_remote(remote_spill))
        if writes:
            await asyncio.gather(*writes)

    def in_background(self, disk_job: SpillJob | None, remote_job: SpillJob | None) -> None:
        """Start a committed store's write-through jobs (to disk, to the remote tier) as background tasks."""
        if disk_job is not None:
            self._tasks.spawn(self.spill(disk_job), background=True)
        if remote_job is not None:
            self._tasks.spawn(self.write_remote(remote_job), background=True)

    async def write_remote(self, job: SpillJob) -> None:
        """CPU -> remote; never raises for Redis faults (the store degrades and answers False)."""
        try:
            await self._dispatch.run(job)
        finally:
            self._m.room.complete_remote_write(job)
            self._progress.notify()  # its pins are released: a load waiting for room may go on

    async def spill(self, job: SpillJob) -> None:
        """CPU -> disk; the manager commits what was written. Never raises for disk faults."""
        disk = self._disk
        ok = None  # cancelled or failed before the write said: nothing counts as written
        try:
            ok = await self._dispatch.run(job) if disk is not None and disk.writable else None
        except DiskError as exc:
            disk.degrade(exc)
        finally:
            if ok is None:
                ok = np.zeros(len(job), dtype=bool)
                self._metrics.drop("cpu", "spill_failed", len(job))
            self._m.room.complete_spill(job, ok)
            self._metrics.spills.inc(int(np.count_nonzero(ok)))
            self._progress.notify()

    async def forget(self, disk_slots: np.ndarray | None) -> None:
        """A reset: journal ``disk_slots`` as invalid (flushed before this returns: a restart recovers
        none) and empty the remote namespace. A remote tier that cannot be emptied is logged, not raised."""
        if self._disk is not None and disk_slots is not None and len(disk_slots):
            self._dispatch.forget(CPU_TO_DISK, disk_slots)
            await self._dispatch.flush(CPU_TO_DISK)
        if self._remote is not None:
            try:
                await self._remote.purge()
            except RemoteError as exc:
                log.warning("tiered_kv reset: the remote tier's namespace could not be emptied: %s", exc)
