"""The scheduler side of the split: the same TieredKVCache over the shared segment and the proxy engine.

The cache's block is the whole TP group's block: its layout is every rank's storages in rank order, so
``bytes_per_block == world_size * shard_bytes`` and a slot's row is exactly the segment's rank-interleaved
row. A disk or remote record therefore holds every rank's shard, and the keys and the disk namespace
name the group (``group_shard_id``), never one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cache import TieredKVCache
from ..capacity import cpu_rows
from ..config import Config, load_config
from ..errors import LayoutError
from ..keys import BlockKeyer
from ..layout import KVLayout
from ..tiers.shared_cpu import SegmentInfo, SharedSegment
from ..tiers.shared_slabs import SharedCpuSlabs
from .proxy import ProxyCopyEngine


def group_layout(shard_layout: KVLayout, world_size: int) -> KVLayout:
    """The TP group's layout: ``shard_layout``'s storages repeated for ranks 0 .. world_size - 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world_size must be an int >= 1, got {world_size!r}")
    return KVLayout.from_specs(shard_layout.storages * world_size, shard_layout.num_blocks,
                               tensors=shard_layout.tensors * world_size,
                               block_tokens=shard_layout.block_tokens)  # fmt: skip


def group_shard_id(world_size: int) -> str:
    """The key and disk namespace's shard name for a whole TP group of ``world_size`` ranks."""
    return f"tp-group-of{world_size}"


def segment_info_for(config: Config | str | dict | None, shard_layout: KVLayout, *, world_size: int,
                     engine_id: str) -> SegmentInfo:  # fmt: skip
    """The segment an engine's scheduler and every rank open: each side computes it from its own
    numbers (a worker from its bound tensors), so whoever opens second checks the first one's."""
    cfg = load_config(config)
    rows = cpu_rows(cfg, group_layout(shard_layout, world_size))  # exactly the scheduler cache's slab rows
    return SegmentInfo.for_engine(cfg.tiers.cpu.shared_path, engine_id, world_size=world_size,
                                  shard_bytes=shard_layout.bytes_per_block, num_slots=rows)  # fmt: skip


@dataclass
class SchedulerSide:
    """A started scheduler-side cache, its proxy engine and the segment workers attach to."""

    cache: TieredKVCache
    proxy: ProxyCopyEngine
    segment_info: SegmentInfo

    @property
    def keyer(self) -> BlockKeyer:
        return self.cache.keyer

    async def aclose(self) -> None:
        await self.cache.aclose()  # drains the proxy, then closes (and removes) the segment


async def open_scheduler_cache(
    config: Config | str | dict | None,
    shard_layout: KVLayout,
    *,
    world_size: int,
    engine_id: str,
    report_timeout_s: float = 60.0,
    on_job: Callable[[], None] | None = None,
    **cache_kwargs: Any,
) -> SchedulerSide:
    """Build and start the scheduler's cache (call on its loop).

    ``shard_layout`` is one rank's layout as the scheduler sees it (from vLLM's kv_cache_config: logical
    sizes and num_blocks; unbound). The segment ``<tiers.cpu.shared_path>/tkv-<engine_id>.kv`` is opened
    here (created unless a worker made it first: see ``segment_info_for``); the last process out removes it.
    """
    cfg = load_config(config)
    layout = group_layout(shard_layout, world_size)
    info = segment_info_for(cfg, shard_layout, world_size=world_size, engine_id=engine_id)

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

    cache = TieredKVCache(cfg, layout, shard_id=group_shard_id(world_size), slabs_factory=slabs,
                          engine_factory=engine, **cache_kwargs)  # fmt: skip
    await cache.start()
    return SchedulerSide(cache, cache._engine, cache.slabs.segment.info)
