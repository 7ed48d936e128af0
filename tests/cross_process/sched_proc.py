"""A scheduler process for the restart test: stores rows (playing its ranks), lets them reach the disk,
says so, then waits to be SIGKILLed. usage: sched_proc.py TMP_PATH [unlink]: with ``unlink`` it removes the
segment's name first, as the connector does once every rank has mapped it."""

import asyncio
import sys

import numpy as np
from scheduler_helpers import SHARD, WORLD, play_ranks, scheduler


async def main(tmp_path: str) -> None:
    from pathlib import Path

    side = await scheduler(Path(tmp_path), engine_id="before", disk_blocks=32, spill="write_through")
    keys = side.keyer.keys_for_block_ids(range(6))
    rows = np.random.default_rng(7).integers(0, 256, (6, WORLD * SHARD), dtype=np.uint8)
    store = asyncio.ensure_future(side.cache.store(keys, list(range(6))))
    await play_ranks(side, rows)
    assert (await store).stored == 6
    while side.cache.stats()["disk"]["resident"] < 6:  # write-through: committed to the disk journal
        await asyncio.sleep(0.01)
    if sys.argv[2:] == ["unlink"]:
        side.segment_mapped_by_all()
    print(side.segment_info.path, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
