"""kill -9 of a scheduler: the next start reclaims its segment unread and serves its disk blocks byte-exact."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from split_helpers import SHARD, WORLD, play_ranks, scheduler

HERE = Path(__file__).parent


async def test_after_a_kill_the_next_start_serves_whole_rows_from_disk(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE)]))
    proc = subprocess.Popen([sys.executable, str(HERE / "sched_proc.py"), str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    try:
        path = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
        path = path.strip()
        assert path and Path(path).exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert Path(path).exists()  # left behind by the killed engine
    side = await scheduler(tmp_path, engine_id="after", disk_blocks=32, spill="write_through")
    try:
        assert not Path(path).exists()  # reclaimed at this start, never read
        keys = side.keyer.keys_for_block_ids(range(6))
        hit = side.cache.lookup(keys)
        assert (hit.cpu, hit.disk) == (0, 6)  # the CPU tier starts empty; the disk tier survived
        load = asyncio.ensure_future(side.cache.load(keys, list(range(10, 16))))
        got = await play_ranks(side)
        assert await load == 6
        rows = np.random.default_rng(7).integers(0, 256, (6, WORLD * SHARD), dtype=np.uint8)
        assert np.array_equal(got, rows)  # every rank's shard of every block, byte-exact
    finally:
        await side.aclose()
