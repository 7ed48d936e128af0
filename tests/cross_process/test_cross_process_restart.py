"""kill -9 of a scheduler: the next start reclaims its segment unread and serves its disk blocks byte-exact."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import legacy_disk_writer as legacy
import numpy as np
import pytest
from scheduler_helpers import SHARD, WORLD, play_ranks, scheduler
from slab_blocks import read_blocks

import tiered_kv as tkv
from tiered_kv.cross_process import open_scheduler_cache

HERE = Path(__file__).parent


@pytest.mark.parametrize("unlinked", [False, True], ids=["named", "unlinked"])
async def test_after_a_kill_the_next_start_serves_whole_rows_from_disk(tmp_path, unlinked):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE.parent), str(HERE)]))
    proc = subprocess.Popen([sys.executable, str(HERE / "sched_proc.py"), str(tmp_path), *(["unlink"] * unlinked)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    try:
        path = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
        path = path.strip()
        assert path and Path(path).exists() != unlinked  # once every process mapped it, the name is gone
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    left = sorted(p.name for p in tmp_path.glob("tkv-before.*"))
    # killed: an unlinked segment is gone with its last mapping, only its empty lock file is left
    assert left == (["tkv-before.live"] if unlinked else ["tkv-before.kv", "tkv-before.live"])
    side = await scheduler(tmp_path, engine_id="after", disk_blocks=32, spill="write_through")
    try:
        assert not list(tmp_path.glob("tkv-before.*"))  # reclaimed at this start, never read
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


async def test_a_disk_tier_written_with_the_interleaved_rows_reads_back(tmp_path):
    """Records keep rank 0 .. N-1 byte order: a disk tier the rank-interleaved segment wrote (a fixture made
    by legacy_disk_writer.py under that layout's code) reads back byte-exact into the rank-major one."""
    with tarfile.open(HERE / "data" / "interleaved_tp2_disk.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    for d, _, names in os.walk(tmp_path / "disk"):  # the disk tier trusts only private files of ours
        os.chmod(d, 0o700)
        for n in names:
            os.chmod(os.path.join(d, n), 0o600)
    (tmp_path / "shm").mkdir(mode=0o700)
    jobs = asyncio.Event()
    side = await open_scheduler_cache(legacy.config(tmp_path), tkv.KVLayout.from_block_bytes(list(legacy.REGIONS), 64),
                                      world_size=legacy.WORLD, engine_id="now", on_job=jobs.set)  # fmt: skip
    try:
        keys = side.keyer.keys_for_block_ids(range(legacy.BLOCKS))
        assert side.cache.lookup(keys).disk == legacy.BLOCKS
        load = asyncio.ensure_future(side.cache.load(keys, list(range(20, 20 + legacy.BLOCKS))))
        await asyncio.wait_for(jobs.wait(), 30)
        (job,) = side.proxy.take_jobs()
        got = read_blocks(side.cache.slabs, job.cpu_slots)  # what the ranks would copy out, rank by rank
        for rank in range(legacy.WORLD):
            side.proxy.report(rank, [job.job_id])
        assert await load == legacy.BLOCKS
        assert np.array_equal(got, legacy.rows())  # every record verified (checksum over the pieces) and whole
    finally:
        await side.aclose()
