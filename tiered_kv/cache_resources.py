"""What a started TieredKVCache holds besides its bookkeeping: the CPU slab, the copy engine, and the
disk and remote tiers' I/O, each registered with the dispatcher for its (source, destination) media.

The cache's lifecycle opens them all or none (``open``; a failure leaves whatever was taken for
``release``) and releases them in reverse, the slab last and only once the engine has drained
every copy that may touch it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .config import Config
from .formats import DiskNamespace
from .layout import KVLayout
from .metrics import CacheMetrics
from .tiers.disk import RecoveredBlock
from .transfer.engines import CopyEngine
from .transfer.handlers import DiskIO, Dispatcher, register_engine


class CacheResources:
    """The slab, the engine, ``disk`` (a DiskIO, or None) and ``remote`` (a RemoteIO, or None)."""

    def __init__(self) -> None:
        self.slabs: Any = None  # tiers.cpu.CpuSlabs, or a scheduler's shared segment
        self.engine: CopyEngine | None = None
        self.disk: DiskIO | None = None
        self.remote: Any = None  # transfer.handlers.remote_io.RemoteIO while a remote tier is configured and open
        self.recovered: list[RecoveredBlock] = []  # the disk blocks an earlier run committed

    async def open(
        self,
        cfg: Config,
        layout: KVLayout,
        dispatcher: Dispatcher,
        metrics: CacheMetrics,
        *,
        rows: int,
        slabs_factory: Callable[[KVLayout, int], Any],
        engine_factory: Callable[[Any], CopyEngine],
        disk_namespace: DiskNamespace | None,
        disk_slots: int | None,
        on_disk_degraded: Callable[[], None],
        remote_namespace: str | None,
        remote_blocks: int,
    ) -> None:
        """Take the slab (``rows`` rows), the engine, the disk tier (with a namespace) and the remote tier
        (with one)."""
        # Allocating and pinning a large slab takes seconds: keep it off the loop.
        self.slabs = await asyncio.get_running_loop().run_in_executor(None, slabs_factory, layout, rows)
        self.engine = engine_factory(self.slabs)
        register_engine(dispatcher, self.engine)
        if disk_namespace is not None:
            self.disk, self.recovered = await DiskIO.open(
                cfg.tiers.disk, disk_namespace, disk_slots, self.slabs, metrics, on_disk_degraded
            )
            dispatcher.register("cpu", "disk", self.disk.write)
            dispatcher.register("disk", "cpu", self.disk.read)
        if remote_namespace is not None:
            from .transfer.handlers.remote_io import RemoteIO  # redis-py is an optional extra

            self.remote = await RemoteIO.open(cfg.tiers.remote, remote_namespace, self.slabs, metrics, remote_blocks)
            dispatcher.register("cpu", "remote", self.remote.write)
            dispatcher.register("remote", "cpu", self.remote.read)

    async def release(self) -> None:
        """Release in reverse; the slab only after the copy engine has drained every copy."""
        drained = self.engine is None
        try:
            if self.engine is not None:
                await self.engine.aclose()  # waits for every copy first
            drained = True
            if self.remote is not None:
                remote, self.remote = self.remote, None
                await remote.aclose()  # stops its background probe first
            if self.disk is not None:
                disk, self.disk = self.disk, None
                await disk.store.aclose()
        finally:
            if self.slabs is not None and drained:  # never unregister memory a copy may still touch
                self.slabs.release()
                self.slabs = None
