"""The remote tier over the scheduler's shared segment: a whole TP group's row goes to Redis and comes back.

No workers here: the test writes the ranks' shards into the segment rows itself (what the workers'
copies do) and reports the jobs done; test_cross_process_e2e.py runs real worker processes.
"""

from __future__ import annotations

import asyncio

import numpy as np
from slab_blocks import read_blocks, write_blocks

import tiered_kv as tkv
from tiered_kv.cross_process import open_scheduler_cache

SHARD, WORLD = 1024, 2


def cfg(tmp_path, url):
    return {"model": {"model_id": "split-remote", "bytes_per_block": WORLD * SHARD}, "gpu": {"num_blocks": 32},
            "tiers": {"cpu": {"capacity": 8 * WORLD * SHARD, "shared_path": str(tmp_path)},
                      "disk": {"enabled": False}, "remote": {"enabled": True, "url": url}}}  # fmt: skip


async def play_workers(side, fill=None):
    """One step of every rank: take the queued job, copy (into the rows: ``fill``; out of them: read), report."""
    for _ in range(2000):
        jobs = side.proxy.take_jobs()
        if jobs:
            (job,) = jobs
            out = None
            if fill is not None:
                write_blocks(side.cache.slabs, job.cpu_slots, fill)  # each rank's piece into its sub-slab
            else:
                out = read_blocks(side.cache.slabs, job.cpu_slots)
            for rank in range(WORLD):
                side.proxy.report(rank, [job.job_id])
            return out
        await asyncio.sleep(0.005)
    raise AssertionError("no job was queued")


async def test_a_tp_groups_rows_round_trip_through_redis(redis_server, tmp_path):
    layout = tkv.KVLayout.from_block_bytes([768, 256], 32)
    rows = np.random.default_rng(3).integers(0, 256, (3, WORLD * SHARD), dtype=np.uint8)
    first = await open_scheduler_cache(cfg(tmp_path, redis_server.url), layout, world_size=WORLD, engine_id="one")
    keys = first.keyer.keys_for_block_ids(range(3))
    store = asyncio.ensure_future(first.cache.store(keys, [4, 5, 6]))
    await play_workers(first, fill=rows)
    assert (await store).stored == 3
    for _ in range(400):  # write-through to Redis runs in the background
        if len(first.cache.remote.residency) >= 3:
            break
        await asyncio.sleep(0.01)
    await first.aclose()

    second = await open_scheduler_cache(cfg(tmp_path, redis_server.url), layout, world_size=WORLD, engine_id="two")
    assert second.keyer.keys_for_block_ids(range(3)) == keys  # same group namespace, another engine instance
    hit = await second.cache.probe(keys)
    assert hit.remote == 3
    load = asyncio.ensure_future(second.cache.load(keys, [7, 8, 9]))
    got = await play_workers(second)
    assert await load == 3
    assert np.array_equal(got, rows)  # every rank's shard came back, byte-exact
    await second.aclose()


async def test_kv_replicated_across_the_tp_group_is_one_shard_per_redis_value(redis_server, tmp_path):
    """MLA at TP=2 (kv_replicas 2): the segment stores one shard per block, so a Redis value holds one
    rank's bytes, not two, and it round-trips byte-exact."""
    layout = tkv.KVLayout.from_block_bytes([768, 256], 32)
    one = cfg(tmp_path, redis_server.url)
    one["model"]["bytes_per_block"] = SHARD
    rows = np.random.default_rng(4).integers(0, 256, (3, SHARD), dtype=np.uint8)
    first = await open_scheduler_cache(one, layout, world_size=WORLD, engine_id="r1", kv_replicas=WORLD)
    assert first.cache.slabs.bytes_per_block == SHARD
    keys = first.keyer.keys_for_block_ids(range(3))
    store = asyncio.ensure_future(first.cache.store(keys, [4, 5, 6]))
    await play_workers(first, fill=rows)
    assert (await store).stored == 3
    for _ in range(400):
        if len(first.cache.remote.residency) >= 3:
            break
        await asyncio.sleep(0.01)
    await first.aclose()
    sizes = [int(redis_server.cli("STRLEN", k)) for k in redis_server.cli("KEYS", "*").split()]
    values = [s for s in sizes if s >= SHARD]  # the block values (the tier keeps a small marker key too)
    assert len(values) == 3 and all(s < 2 * SHARD for s in values), sizes  # one shard (and a header) each

    second = await open_scheduler_cache(one, layout, world_size=WORLD, engine_id="r2", kv_replicas=WORLD)
    assert (await second.cache.probe(keys)).remote == 3
    load = asyncio.ensure_future(second.cache.load(keys, [7, 8, 9]))
    assert np.array_equal(await play_workers(second), rows)
    assert await load == 3
    await second.aclose()
