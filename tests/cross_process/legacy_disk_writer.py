"""Writes a TP=2 group's blocks to a disk tier through the scheduler's cache (write-through), then stops.

Runs against any tiered_kv with the scheduler/worker split (today's rank-major segment or the interleaved rows
before it): it only uses ``slabs.slab_np``'s slot axis. ``tests/cross_process/data/interleaved_tp2_disk.tar`` was
made with it under the interleaved layout (PYTHONPATH=<that checkout> python legacy_disk_writer.py OUT_DIR), so
test_cross_process_restart can check that a disk tier written then reads back now.
usage: legacy_disk_writer.py OUT_DIR
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np

REGIONS, WORLD, BLOCKS = (768, 256), 2, 6


def config(out: Path) -> dict:
    shard = sum(REGIONS)
    return {"model": {"model_id": "split-legacy", "bytes_per_block": WORLD * shard}, "gpu": {"num_blocks": 64},
            "tiers": {"cpu": {"capacity": 16 * WORLD * shard, "shared_path": str(out / "shm")},
                      "disk": {"enabled": True, "path": str(out / "disk"), "capacity": 32 * WORLD * shard,
                               "spill_policy": "write_through"}}}  # fmt: skip


def rows() -> np.ndarray:
    return np.random.default_rng(27).integers(0, 256, (BLOCKS, WORLD * sum(REGIONS)), dtype=np.uint8)


async def main(out: Path) -> None:
    import tiered_kv as tkv
    try:
        from tiered_kv.cross_process import open_scheduler_cache
    except ImportError:  # a checkout from before tiered_kv.cross_process (then tiered_kv.split)
        from tiered_kv.split.scheduler import open_scheduler_cache

    (out / "shm").mkdir(mode=0o700, parents=True, exist_ok=True)
    jobs = asyncio.Event()
    side = await open_scheduler_cache(config(out), tkv.KVLayout.from_block_bytes(list(REGIONS), 64), world_size=WORLD,
                                      engine_id="legacy", on_job=jobs.set)  # fmt: skip
    keys = side.keyer.keys_for_block_ids(range(BLOCKS))
    store = asyncio.ensure_future(side.cache.store(keys, list(range(BLOCKS))))
    await jobs.wait()
    (job,) = side.proxy.take_jobs()
    slab = side.cache.slabs.slab_np
    slab[job.cpu_slots] = rows().reshape(BLOCKS, *slab.shape[1:])  # what the two ranks' copies would write
    for rank in range(WORLD):
        side.proxy.report(rank, [job.job_id])
    assert (await store).stored == BLOCKS
    while side.cache.stats()["disk"]["resident"] < BLOCKS:
        await asyncio.sleep(0.01)
    await side.aclose()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
