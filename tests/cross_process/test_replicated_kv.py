"""KV that is the same on every TP rank (MLA) is stored once: segment geometry, header, ShardCopier, records.

Pure geometry first, then a real segment, two in-process ShardCopiers over real tensors, and a scheduler
cache over the proxy engine with a disk tier: the CPU tier, the disk record and the copies hold one rank's
shard, rank 0 alone writes it, every rank reports every job and every rank loads the same bytes.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from scheduler_helpers import REGIONS, SHARD, shard_layout

import tiered_kv as tkv
from tiered_kv.cross_process import LOAD, STORE, ShardCopier, ShardJob, open_scheduler_cache
from tiered_kv.errors import ConfigError, LayoutError
from tiered_kv.tiers.segment_geometry import (
    PAGE,
    SegmentInfo,
    group_layout,
    group_shard_id,
    round_up,
    segment_info_for,
    storage_ranks,
)
from tiered_kv.tiers.shared_cpu import _HEADER, SharedSegment
from tiered_kv.tiers.slab_parts import SlabParts

WORLD = 2


def cfg_for(tmp_path, *, stored: int, cpu_blocks: int = 16, disk_blocks: int = 0) -> dict:
    """A config sized in stored blocks: ``stored`` ranks' shards per block (1 when replicated)."""
    cfg = {"model": {"model_id": "mla-test", "bytes_per_block": stored * SHARD}, "gpu": {"num_blocks": 64},
           "tiers": {"cpu": {"capacity": cpu_blocks * stored * SHARD, "shared_path": str(tmp_path)},
                     "disk": {"enabled": False}}}  # fmt: skip
    if disk_blocks:
        cfg["tiers"]["disk"] = {"enabled": True, "path": str(tmp_path / "disk"), "capacity": disk_blocks * stored * SHARD,
                                "spill_policy": "write_through"}  # fmt: skip
    return cfg


# -- geometry (pure) ---------------------------------------------------------------------------------
def test_replicated_geometry_stores_one_sub_slab_that_every_rank_shares():
    plain = SegmentInfo.for_engine("/x", "e", world_size=2, shard_bytes=3000, num_slots=100)
    mla = SegmentInfo.for_engine("/x", "e", world_size=2, shard_bytes=3000, num_slots=100, kv_replicas=2)
    assert (plain.storage_ranks, mla.storage_ranks) == (2, 1)
    assert (plain.row_bytes, mla.row_bytes) == (6000, 3000)
    stride = round_up(300_000, PAGE)
    assert plain.file_bytes == PAGE + 2 * stride and mla.file_bytes == PAGE + stride  # half the slots' bytes
    assert [plain.rank_offset(r) for r in (0, 1)] == [PAGE, PAGE + stride]
    assert [mla.rank_offset(r) for r in (0, 1)] == [PAGE, PAGE]
    assert [plain.stores(r) for r in (0, 1)] == [True, True] and [mla.stores(r) for r in (0, 1)] == [True, False]
    with pytest.raises(LayoutError, match="rank 2 is outside the segment's TP group of world_size 2"):
        mla.rank_offset(2)
    with pytest.raises(LayoutError, match="sub-slab 1 is outside the segment's 1 stored ranks"):
        mla.sub_slab_offset(1)


def test_partial_replicas_pair_up_consecutive_ranks():
    """vLLM's kv_tp_replicas counts *consecutive* ranks holding identical KV: TP=4 with 2 replicas stores 2."""
    info = SegmentInfo.for_engine("/x", "e", world_size=4, shard_bytes=4096, num_slots=10, kv_replicas=2)
    assert info.storage_ranks == 2
    assert [info.storage_rank_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [info.stores(r) for r in range(4)] == [True, False, True, False]
    assert info.file_bytes == PAGE + 2 * round_up(40960, PAGE)


def test_replicas_that_do_not_divide_the_tp_size_are_refused_naming_both():
    with pytest.raises(ConfigError, match="kv_replicas .* is 3, which does not divide the TP size 4"):
        storage_ranks(4, 3)
    with pytest.raises(ConfigError, match="kv_replicas must be an int >= 1, got 0"):
        SegmentInfo.for_engine("/x", "e", world_size=2, shard_bytes=1, num_slots=1, kv_replicas=0)
    with pytest.raises(ConfigError, match="which does not divide the TP size 2"):
        group_layout(shard_layout(), 2, 4)


def test_both_sides_size_a_replicated_segment_alike_and_half_as_large_per_block(tmp_path):
    """The scheduler's cache layout and the segment come from the same functions; the group block (and so
    every slot, record and capacity figure) is one shard, not world_size of them."""
    layout = shard_layout()
    assert group_layout(layout, WORLD).bytes_per_block == WORLD * SHARD
    assert group_layout(layout, WORLD, WORLD).bytes_per_block == SHARD
    assert group_layout(layout, WORLD, WORLD).digest == group_layout(layout, 1).digest  # one rank's regions
    assert group_shard_id(WORLD) == "tp-group-of2"  # unchanged: old disk tiers keep their namespace
    assert group_shard_id(WORLD, WORLD) == "tp-group-of2-replicated"
    assert group_shard_id(4, 2) == "tp-group-of4-stored2"
    cfg = {"model": {"model_id": "m", "bytes_per_block": SHARD},
           "tiers": {"cpu": {"capacity": 40 * SHARD, "shared_path": str(tmp_path)}, "disk": {"enabled": False}}}  # fmt: skip
    mla = segment_info_for(cfg, layout, world_size=WORLD, engine_id="g", kv_replicas=WORLD)
    per_rank = segment_info_for(dict(cfg, model={"model_id": "m", "bytes_per_block": WORLD * SHARD}), layout,
                                world_size=WORLD, engine_id="g")  # fmt: skip
    assert mla.kv_replicas == WORLD and mla.row_bytes == SHARD and per_rank.row_bytes == WORLD * SHARD
    # The same capacity holds twice the blocks; the same blocks take half the segment.
    assert mla.num_slots == 2 * per_rank.num_slots  # (staging rows included: sized in bytes too)
    same = {"world_size": WORLD, "shard_bytes": SHARD, "num_slots": 48}
    one = SegmentInfo.for_engine(str(tmp_path), "g", kv_replicas=WORLD, **same)
    each = SegmentInfo.for_engine(str(tmp_path), "g", **same)
    assert 2 * (one.file_bytes - one.header_bytes) == each.file_bytes - each.header_bytes


# -- the segment header ---------------------------------------------------------------------------------
def test_the_header_records_replicas_and_a_plain_segment_keeps_its_old_header(tmp_path):
    plain = SharedSegment.open(SegmentInfo.for_engine(str(tmp_path), "p", world_size=2, shard_bytes=SHARD,
                                                      num_slots=4))  # fmt: skip
    raw = bytes(plain._map[: PAGE])
    assert raw[_HEADER.size :] == bytes(PAGE - _HEADER.size)  # nothing past the version-2 header: as before
    plain.close()
    info = SegmentInfo.for_engine(str(tmp_path), "r", world_size=2, shard_bytes=SHARD, num_slots=4, kv_replicas=2)
    seg = SharedSegment.open(info)
    assert seg.blocks.shape == (4, 1, SHARD) and seg.shard(1).ctypes.data == seg.shard(0).ctypes.data
    # A process that would store a copy per rank is refused, naming both numbers.
    other = SegmentInfo.for_engine(str(tmp_path), "r", world_size=2, shard_bytes=SHARD, num_slots=4)
    with pytest.raises(LayoutError, match="made for kv_replicas 2 .* but this process expects 1"):
        SharedSegment.open(other)
    seg.close()


# -- the copier --------------------------------------------------------------------------------------
def rank_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randint(0, 256, (64, REGIONS[0]), dtype=torch.uint8, generator=g),
            "v": torch.randint(0, 256, (64, REGIONS[1]), dtype=torch.uint8, generator=g)}  # fmt: skip


def copiers(tmp_path, kvs, cfg, *, replicas: int = WORLD, engine_id: str = "w") -> list[ShardCopier]:
    out = []
    for rank, kv in enumerate(kvs):
        layout = tkv.KVLayout.from_tensors(kv, 64)
        c = ShardCopier(layout, rank=rank, world_size=WORLD, kv_replicas=replicas)
        c.open(segment_info_for(cfg, layout, world_size=WORLD, engine_id=engine_id, kv_replicas=replicas))
        out.append(c)
    return out


def test_only_rank_0_writes_every_rank_reports_and_every_rank_loads_the_one_copy(tmp_path):
    # Different bytes on each rank (real MLA ranks hold the same): a store that rank 1 copied would show.
    kvs = [rank_kv(0), rank_kv(1)]
    cs = copiers(tmp_path, kvs, cfg_for(tmp_path, stored=1))
    try:
        assert [c.stores for c in cs] == [True, False]
        store = ShardJob(1, STORE, np.array([5, 9, 2]), np.array([0, 1, 7]))
        for c in cs:  # rank 0 first, then rank 1: whatever rank 1 wrote would be what the slots hold
            c.submit([store])
            assert c.drain(30) == ([1], [])  # every rank reports the job done
        seg = cs[1].segment
        assert seg.info.storage_ranks == 1 and seg.blocks.shape[1] == 1
        sub = seg.shard(1)  # rank 1's view is rank 0's sub-slab (its own mapping of it)
        assert seg.info.rank_offset(1) == seg.info.rank_offset(0)
        assert np.array_equal(sub[[0, 1, 7], : REGIONS[0]], kvs[0]["k"][[5, 9, 2]].numpy())
        assert np.array_equal(sub[[0, 1, 7], REGIONS[0] :], kvs[0]["v"][[5, 9, 2]].numpy())
        assert [c.skipped_stores for c in cs] == [0, 1]  # rank 1 acknowledged the job without a copy
        load = ShardJob(2, LOAD, np.array([40, 41, 60]), np.array([0, 1, 7]))
        for c in cs:
            c.submit([load])
            assert c.drain(30) == ([2], [])
        for kv in kvs:  # both ranks loaded the one copy: rank 0's bytes
            for name in kv:
                assert torch.equal(kv[name][[40, 41, 60]], kvs[0][name][[5, 9, 2]])
    finally:
        for c in cs:
            c.close()


def test_a_copier_built_for_other_replicas_than_the_segment_refuses(tmp_path):
    layout = tkv.KVLayout.from_tensors(rank_kv(0), 64)
    info = segment_info_for(cfg_for(tmp_path, stored=2), layout, world_size=WORLD, engine_id="x")
    c = ShardCopier(layout, rank=1, world_size=WORLD, kv_replicas=WORLD)
    with pytest.raises(LayoutError, match="segment info is for kv_replicas 1 .* TP rank 1 was built for 2"):
        c.open(info)
    c.close()
    with pytest.raises(ConfigError, match="does not divide the TP size 2"):
        ShardCopier(layout, rank=0, world_size=WORLD, kv_replicas=3)


# -- the scheduler's cache: CPU tier, disk records, the proxy's reports ------------------------------------
async def pump(side, cs, stop: asyncio.Event) -> None:
    """The connector's step loop: jobs to every rank, every rank's completions back to the proxy."""
    while not stop.is_set():
        jobs = side.proxy.take_jobs()
        if jobs:
            for c in cs:
                c.submit(jobs)
        for c in cs:
            ok, bad = c.poll()
            if ok or bad:
                side.proxy.report(c.rank, ok, bad)
        await asyncio.sleep(0.002)


async def test_scheduler_cache_holds_one_copy_in_cpu_and_on_disk(tmp_path):
    cfg = cfg_for(tmp_path, stored=1, cpu_blocks=4, disk_blocks=64)
    kvs = [rank_kv(3), rank_kv(3)]  # replicated KV: the same bytes on both ranks
    cs = copiers(tmp_path, kvs, cfg, engine_id="s")
    side = await open_scheduler_cache(cfg, shard_layout(), world_size=WORLD, engine_id="s", kv_replicas=WORLD)
    stop = asyncio.Event()
    task = asyncio.ensure_future(pump(side, cs, stop))
    try:
        assert side.segment_info == cs[0].segment.info  # both sides computed the same segment
        cache = side.cache
        assert cache.layout.bytes_per_block == SHARD and cache.slabs.bytes_per_block == SHARD
        assert len(SlabParts(cache.slabs.slab_np)) == 1  # one iovec per record: one rank's shard
        keys = side.keyer.keys_for_block_ids(range(12))
        for a in range(0, 12, 4):  # 12 blocks through a 4-slot CPU tier: they spill whole to disk
            assert (await cache.store(keys[a : a + 4], list(range(a, a + 4)))).stored == 4
        await asyncio.sleep(0.3)
        assert cache.lookup(keys).disk >= 8
        assert [c.skipped_stores for c in cs] == [0, 3]  # rank 1 acknowledged every store job, copied none
        ns = next((tmp_path / "disk").glob("ns-*"))
        meta = json.loads((ns / "namespace.json").read_text())
        assert meta["bytes_per_block"] == SHARD and meta["shard"] == "tp-group-of2-replicated"
        assert meta["record_size"] == round_up(128 + SHARD, 4096)  # one rank's shard and a record header
        for kv in kvs:
            for t in kv.values():
                t[32:] = 0
        got = 0
        while got < 12:  # promoted from disk through the CPU tier, loaded by both ranks
            n = await cache.load(keys[got:], list(range(32 + got, 44)))
            assert n > 0
            got += n
        for kv in kvs:
            for t in kv.values():
                assert torch.equal(t[32:44], t[0:12])
        cache.check_invariants()
    finally:
        stop.set()
        await task
        await side.aclose()
        for c in cs:
            c.close()
