"""Kept partial last blocks in the replay's emulator sit at the cold end of the tiers, as the vLLM
connector keeps its partial tail records (issue 39 item 2): the first to go under pressure."""

from __future__ import annotations

from replay_helpers import small_config

import tiered_kv as tkv
from tiered_kv.replay.engine import EngineEmulator, run_requests
from tiered_kv.replay.instance import make_kv
from tiered_kv.replay.run import resolve_config
from tiered_kv.replay.trace import Request


async def _open(tmp_path, **tiers):
    cfg = resolve_config(small_config(tmp_path, **tiers))
    kv = make_kv(cfg)
    layout = tkv.KVLayout.from_tensors(kv, cfg.gpu.num_blocks)
    return await tkv.TieredKVCache(cfg, layout).start(), list(layout.regions)


async def test_a_kept_partial_block_is_the_first_to_go_under_pressure(tmp_path):
    cache, regions = await _open(tmp_path, gpu=8, cpu=4, disk_enabled=False)
    try:
        engine = EngineEmulator(cache, regions, exclusive=False, drop_partial=False)  # stores at once
        old = Request(0.0, 512, 1, (1,))
        chat = Request(1.0, 512 + 100, 1, (2, 3))  # block 3 is partial: kept, at the cold end
        await run_requests(engine, [old, chat], concurrency=1)
        keys = cache.keyer.keys_for_block_ids
        assert cache.tiers_of(keys((1,)) + keys((2, 3))) == ["cpu", "cpu", "cpu"]
        # Two more full blocks need one slot more than is free: the partial block goes, not block 1,
        # the least recently used full block.
        await run_requests(engine, [Request(2.0, 1024, 1, (4, 5))], concurrency=1)
        engine.close()
        assert cache.tiers_of(keys((1,)) + keys((2, 3))) == ["cpu", "cpu", ""]
        assert cache.lookup(keys((4, 5))).total == 2
    finally:
        await cache.aclose()


async def test_dropped_partial_blocks_are_never_stored(tmp_path):
    cache, regions = await _open(tmp_path, gpu=8, cpu=4, disk_enabled=False)
    try:
        engine = EngineEmulator(cache, regions, exclusive=False)  # drop_partial by default
        await run_requests(engine, [Request(0.0, 512 + 100, 1, (2, 3))], concurrency=1)
        engine.close()
        assert cache.tiers_of(cache.keyer.keys_for_block_ids((2, 3))) == ["cpu", ""]
        assert engine.stats.partial_dropped == 1
    finally:
        await cache.aclose()
