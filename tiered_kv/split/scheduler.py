"""The scheduler side of the split: the same TieredKVCache over the shared segment and the proxy engine.

The cache's block is the whole TP group's block: its layout is every stored rank's storages in rank order,
so ``bytes_per_block == storage_ranks * shard_bytes``. In the rank-major segment a slot's block is its ranks'
pieces (tiers/segment_geometry.py); a disk or remote record holds them in rank order, so it holds every
stored rank's shard, and the keys and the disk namespace name the group (``group_shard_id``), never one rank.
``storage_ranks`` is ``world_size`` unless the KV is the same on ``kv_replicas`` ranks (MLA): then one copy
per replica set is stored, written by one rank; every rank still reports every job, so the proxy counts
``world_size`` reports as always.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cache import TieredKVCache
from ..config import Config, load_config
from ..errors import LayoutError
from ..keys import BlockKeyer
from ..layout import KVLayout
from ..tiers.segment_geometry import SegmentInfo, group_layout, group_shard_id, segment_info_for
from ..tiers.shared_cpu import SharedSegment
from ..tiers.shared_slabs import SharedCpuSlabs
from .proxy import ProxyCopyEngine

__all__ = ["SchedulerSide", "group_layout", "group_shard_id", "open_scheduler_cache", "segment_info_for"]


@dataclass
class SchedulerSide:
    """A started scheduler-side cache, its proxy engine and the segment workers attach to."""

    cache: TieredKVCache
    proxy: ProxyCopyEngine
    segment_info: SegmentInfo

    @property
    def keyer(self) -> BlockKeyer:
        return self.cache.keyer

    def segment_mapped_by_all(self) -> None:
        """Every process of the engine has mapped the segment (the scheduler and every rank): remove its
        name, so nothing of it outlives the engine in the directory (SharedSegment.unlink_name)."""
        self.cache.slabs.segment.unlink_name()

    async def aclose(self) -> None:
        await self.cache.aclose()  # drains the proxy, then closes (and removes) the segment


async def open_scheduler_cache(
    config: Config | str | dict | None,
    shard_layout: KVLayout,
    *,
    world_size: int,
    engine_id: str,
    kv_replicas: int = 1,
    report_timeout_s: float = 60.0,
    on_job: Callable[[], None] | None = None,
    **cache_kwargs: Any,
) -> SchedulerSide:
    """Build and start the scheduler's cache (call on its loop).

    ``shard_layout`` is one rank's layout as the scheduler sees it (from vLLM's kv_cache_config: logical
    sizes and num_blocks; unbound). The segment ``<tiers.cpu.shared_path>/tkv-<engine_id>.kv`` is opened
    here (created unless a worker made it first: see ``segment_info_for``); the last process out removes it.
    ``kv_replicas``: consecutive TP ranks whose KV is identical (vLLM's ``kv_tp_replicas``), stored once.
    """
    cfg = load_config(config)
    layout = group_layout(shard_layout, world_size, kv_replicas)
    info = segment_info_for(cfg, shard_layout, world_size=world_size, engine_id=engine_id, kv_replicas=kv_replicas)

    def slabs(layout: KVLayout, rows: int) -> SharedCpuSlabs:
        if rows != info.num_slots:  # the cache and segment_info_for size the slab with one function
            raise LayoutError(f"the cache wants {rows} CPU rows but the segment was sized for {info.num_slots}")
        seg = SharedSegment.open(info, scheduler=True)
        try:
            return SharedCpuSlabs(seg, layout.region_block_bytes)
        except BaseException:
            seg.close()
            raise

    def engine(slabs: SharedCpuSlabs) -> ProxyCopyEngine:
        return ProxyCopyEngine(world_size, layout.num_blocks, slabs.num_slots, bytes_per_block=layout.bytes_per_block,
                               report_timeout_s=report_timeout_s, on_job=on_job)  # fmt: skip

    cache = TieredKVCache(cfg, layout, shard_id=group_shard_id(world_size, kv_replicas), slabs_factory=slabs,
                          engine_factory=engine, **cache_kwargs)  # fmt: skip
    await cache.start()
    return SchedulerSide(cache, cache.engine, cache.slabs.segment.info)
