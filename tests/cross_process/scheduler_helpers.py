"""A scheduler-side cache on the proxy engine, sized for tests (two TP ranks of 1 KiB shards)."""

from __future__ import annotations

import asyncio

from slab_blocks import read_blocks, write_blocks

import tiered_kv as tkv
from tiered_kv.cross_process import open_scheduler_cache

WORLD = 2
REGIONS = (768, 256)  # one rank's regions: its shard of a block is 1 KiB
SHARD = sum(REGIONS)


def shard_layout(num_blocks: int = 64) -> tkv.KVLayout:
    """One rank's layout as a scheduler sees it: sizes only, no tensors."""
    return tkv.KVLayout.from_block_bytes(list(REGIONS), num_blocks)


def config(tmp_path, *, cpu_blocks: int = 16, disk_blocks: int = 0, world: int = WORLD, num_blocks: int = 64,
           spill: str = "write_back"):  # fmt: skip
    cfg = {
        "model": {"model_id": "split-test", "bytes_per_block": world * SHARD},
        "gpu": {"num_blocks": num_blocks},
        "tiers": {"cpu": {"capacity": cpu_blocks * world * SHARD, "shared_path": str(tmp_path)},
                  "disk": {"enabled": False}},
    }
    if disk_blocks:
        cfg["tiers"]["disk"] = {"enabled": True, "path": str(tmp_path / "disk"), "capacity": disk_blocks * world * SHARD,
                                "spill_policy": spill}  # fmt: skip
    return cfg


async def scheduler(tmp_path, *, world: int = WORLD, timeout: float = 30.0, engine_id: str = "eng", **kw):
    jobs = asyncio.Event()
    side = await open_scheduler_cache(config(tmp_path, world=world, **kw), shard_layout(), world_size=world,
                                      engine_id=engine_id, report_timeout_s=timeout, on_job=jobs.set)
    side.jobs_ready = jobs
    return side


async def next_jobs(side, timeout: float = 10.0):
    """Wait until the cache has queued a job, then take what is queued (as a connector's step would)."""
    await asyncio.wait_for(side.jobs_ready.wait(), timeout)
    side.jobs_ready.clear()
    await asyncio.sleep(0)
    return side.proxy.take_jobs()


async def play_ranks(side, rows=None, timeout: float = 10.0):
    """Every rank's part of the next job, done in this process: a store's rows are ``rows`` (written into the
    segment as the ranks' copies would), a load's rows are returned (what the ranks would copy out)."""
    (job,) = await next_jobs(side, timeout)
    out = None
    if rows is not None:
        write_blocks(side.cache.slabs, job.cpu_slots, rows)
    else:
        out = read_blocks(side.cache.slabs, job.cpu_slots)
    for rank in range(side.proxy.world_size):
        side.proxy.report(rank, [job.job_id])
    return out
