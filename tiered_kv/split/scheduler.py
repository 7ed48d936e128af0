"""The scheduler side of the split: the same TieredKVCache over the shared segment and the proxy engine.

The cache's block is the whole TP group's block: its layout is every rank's storages in rank order, so
``bytes_per_block == world_size * shard_bytes``. In the rank-major segment a slot's block is its ranks'
pieces (tiers/segment_geometry.py); a disk or remote record holds them in rank order, so it holds every
rank's shard, and the keys and the disk namespace name the group (``group_shard_id``), never one rank.
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
    storage_ranks: int | None = None,
    report_timeout_s: float = 60.0,
    on_job: Callable[[], None] | None = None,
    **cache_kwargs: Any,
) -> SchedulerSide:
    """Build and start the scheduler's cache (call on its loop).

    ``shard_layout`` is one rank's layout as the scheduler sees it (from vLLM's kv_cache_config: logical
    sizes and num_blocks; unbound). The segment ``<tiers.cpu.shared_path>/tkv-<engine_id>.kv`` is opened
    here (created unless a worker made it first: see ``segment_info_for``); the last process out removes it.
    ``storage_ranks``: how many ranks' shards a block holds (default ``world_size``; 1 when every rank holds
    the same KV: one copy in every tier, and each job is still reported by all ``world_size`` ranks).
    """
    cfg = load_config(config)
    stored = world_size if storage_ranks is None else storage_ranks
    if stored not in (1, world_size):
        raise LayoutError(f"storage_ranks must be 1 or world_size ({world_size}), got {stored}")
    layout = group_layout(shard_layout, stored)
    info = segment_info_for(cfg, shard_layout, world_size=stored, engine_id=engine_id)

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

    shard_id = group_shard_id(world_size) + ("-replicated" if stored != world_size else "")
    cache = TieredKVCache(cfg, layout, shard_id=shard_id, slabs_factory=slabs,
                          engine_factory=engine, **cache_kwargs)  # fmt: skip
    await cache.start()
    return SchedulerSide(cache, cache._engine, cache.slabs.segment.info)
