"""Handlers for CPU <-> remote (Redis) jobs, and the remote residency they keep.

A job is any batch with ``keys`` (uint8 [n, key_bytes]) and ``cpu_slots``: SpillJob for
cpu -> remote (write-back on eviction, or write-through after a store), PromoteJob for
remote -> cpu. Each job is one RemoteStore batch: one pipelined round trip per server.
Neither handler raises for a server fault: the store answers False for the batch and
degrades the tier (one WARNING, ``tiered_kv_degraded_events_total{remote}``), and the
cache keeps serving from GPU, CPU and disk. A block that fails verification is a miss
and is dropped from the residency filter; a block not answered (a fault) is kept there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import KeyFormatError, SlotError
from ...manager.key_rows import key_rows
from ...media import CPU_TO_REMOTE, REMOTE_TO_CPU
from ...metrics import CacheMetrics
from ...owned_tasks import TaskSet
from ...tiers.remote import RemoteResidency, RemoteStore

REJECTED_KEYS = 1 << 16


class RemoteIO:
    """Write (CPU -> remote) and promote (remote -> CPU) batches against one RemoteStore."""

    def __init__(self, store: RemoteStore, residency: RemoteResidency, metrics: CacheMetrics) -> None:
        self.store = store
        self.residency = residency
        # Keys whose value was answered but gone or bad: a probe that finds the bad value still
        # there does not offer it again (bounded; the oldest are forgotten).
        self.rejected = RemoteResidency(REJECTED_KEYS)
        self._metrics = metrics
        self.probing: asyncio.Task | None = None  # the background probe (one at a time)

    @classmethod
    async def open(
        cls, cfg: Any, namespace: str, slabs: Any, metrics: CacheMetrics, max_keys: int
    ) -> RemoteIO:
        """Connect (RemoteError naming the URL, never the password, when unreachable)."""
        store = await RemoteStore.open(cfg, namespace, slabs, metrics)
        return cls(store, RemoteResidency(max(1, min(max_keys, 1 << 26))), metrics)

    def known(self, keys: np.ndarray) -> np.ndarray:
        """What the synchronous lookup sees: the residency filter, or nothing while degraded."""
        if self.store.degraded:
            return np.zeros(len(keys), dtype=bool)
        return self.residency.known(keys)

    async def aclose(self) -> None:
        self.stop_probing()
        await self.store.aclose()

    def probe_later(self, keys: Sequence[bytes], key_bytes: int, tasks: TaskSet) -> None:
        """``lookup`` never waits on the network: unknown keys are probed in the background (one probe
        at a time), so a later lookup of the same prefix, here or on the engine's next poll, sees them."""
        if self.probing is not None and not self.probing.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called off the loop thread: nothing to schedule on
            return
        rows = key_rows(keys[:4096], key_bytes)
        rows = rows[~self.residency.known(rows)]
        if len(rows) and not self.store.degraded:
            self.probing = tasks.spawn(self.probe(rows), background=True)

    def stop_probing(self) -> None:
        if self.probing is not None:
            self.probing.cancel()

    async def purge(self) -> int:
        """Forget the namespace: every server's keys of it deleted, the residency filter emptied.
        Returns how many keys Redis deleted; RemoteError when a server failed (the filter is still empty)."""
        from ...tiers.remote.purge import purge_namespace

        self.residency = RemoteResidency(self.residency.max_keys)
        self.rejected = RemoteResidency(REJECTED_KEYS)
        return await purge_namespace(self.store._conns, self.store._prefix)

    def register(self, dispatcher: Any) -> None:
        """CPU -> remote (write-back and write-through) and remote -> CPU (fetches)."""
        dispatcher.register(CPU_TO_REMOTE, self.write)
        dispatcher.register(REMOTE_TO_CPU, self.read)

    @property
    def writable(self) -> bool:
        return not self.store.degraded

    async def write(self, job: Any) -> np.ndarray:
        try:
            ok = await self.store.put(job.keys, job.cpu_slots)
        except (KeyFormatError, SlotError) as e:  # the job's arrays, not the server: nothing was sent
            self._metrics.drop("remote", "invalid_batch", len(job), str(e))
            return np.zeros(len(job), dtype=bool)
        if ok.any():
            self.residency.add(job.keys[ok])
            self.rejected.discard(job.keys[ok])  # our own good value replaced whatever was there
        return ok

    async def read(self, job: Any) -> np.ndarray:
        try:
            ok, answered = await self.store.get_answered(job.keys, job.cpu_slots)
        except (KeyFormatError, SlotError) as e:
            self._metrics.drop("remote", "invalid_batch", len(job), str(e))
            return np.zeros(len(job), dtype=bool)
        gone = answered & ~ok
        if gone.any():
            self.residency.discard(job.keys[gone])
            self.rejected.add(job.keys[gone])
        return ok

    async def probe(self, keys: np.ndarray) -> np.ndarray:
        """Ask Redis which keys it holds (one pipelined EXISTS batch) and remember the present ones."""
        present = await self.store.exists(keys)
        present &= ~self.rejected.known(keys)
        if present.any():
            self.residency.add(keys[present])
        return present
