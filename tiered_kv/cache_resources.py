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

from .capacity import cpu_rows, remote_blocks
from .config import Config
from .identity import disk_namespace, remote_namespace
from .keys import BlockKeyer
from .layout import KVLayout
from .metrics import CacheMetrics
from .tiers.cpu import CpuSlabs
from .tiers.disk import RecoveredBlock
from .transfer.engines import CopyEngine
from .transfer.handlers import DiskIO, Dispatcher, register_engine, register_slab


class CacheResources:
    """The slab, the engine, ``disk`` (a DiskIO, or None) and ``remote`` (a RemoteIO, or None) of a cache
    with this config, layout and keyer; ``disk_slots`` as ``capacity.tier_slots`` counts them.

    ``slabs_factory(layout, rows)`` builds the slab (a scheduler's shared segment; the CPU tier's own
    pinned slab by default), ``engine_factory(slabs)`` the copy engine over it.
    """

    def __init__(
        self,
        cfg: Config,
        layout: KVLayout,
        keyer: BlockKeyer,
        disk_slots: int | None,
        *,
        slabs_factory: Callable[[KVLayout, int], Any] | None,
        engine_factory: Callable[[Any], CopyEngine],
    ) -> None:
        self._cfg, self._layout, self._disk_slots = cfg, layout, disk_slots
        self._slabs_factory = slabs_factory or self._local_slabs
        self._engine_factory = engine_factory
        self._disk_ns = disk_namespace(keyer, layout) if cfg.tiers.disk.enabled else None
        self._remote_ns = remote_namespace(keyer, layout) if cfg.tiers.remote.enabled else None
        self.slabs: Any = None  # tiers.cpu.CpuSlabs, or a scheduler's shared segment
        self.engine: CopyEngine | None = None
        self.disk: DiskIO | None = None
        self.remote: Any = (
            None  # transfer.handlers.remote_io.RemoteIO while a remote tier is configured and open
        )
        self.recovered: list[RecoveredBlock] = []  # the disk blocks an earlier run committed

    def _local_slabs(self, layout: KVLayout, rows: int) -> CpuSlabs:
        cpu = self._cfg.tiers.cpu
        return CpuSlabs(layout, rows, pin=cpu.pin_memory, pin_chunk=cpu.pin_chunk, device=layout.device)

    async def open(
        self, dispatcher: Dispatcher, metrics: CacheMetrics, on_disk_degraded: Callable[[], None]
    ) -> None:
        """Take the slab, the engine and every configured tier below the CPU, registering each with
        ``dispatcher`` for its media; ``on_disk_degraded`` runs once if the disk tier stops writing."""
        cfg, layout = self._cfg, self._layout
        rows = cpu_rows(cfg, layout)  # the same number a shared segment is sized by
        # Allocating and pinning a large slab takes seconds: keep it off the loop.
        self.slabs = await asyncio.get_running_loop().run_in_executor(None, self._slabs_factory, layout, rows)
        self.engine = self._engine_factory(self.slabs)
        register_engine(dispatcher, self.engine)
        register_slab(dispatcher, self.slabs.slab_np, layout.bytes_per_block)
        if self._disk_ns is not None:
            self.disk, self.recovered = await DiskIO.open(
                cfg.tiers.disk, self._disk_ns, self._disk_slots, self.slabs, metrics, on_disk_degraded
            )
            self.disk.register(dispatcher)
        if self._remote_ns is not None:
            from .transfer.handlers.remote_io import RemoteIO  # redis-py is an optional extra

            self.remote = await RemoteIO.open(
                cfg.tiers.remote, self._remote_ns, self.slabs, metrics, remote_blocks(cfg, layout)
            )
            self.remote.register(dispatcher)

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
