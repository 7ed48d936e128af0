"""The disk tier through TieredKVCache: spill, promote, restart, corruption, a full disk."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest
from cache_helpers import cache_for, config, fill, holds, make_kv

from tiered_kv.tiers.disk.format import DATA_FILE


async def store_all(cache, kv, keys, batch=4):
    for i, key in enumerate(keys):
        fill(kv, i, key)
    for i in range(0, len(keys), batch):
        await cache.store(keys[i : i + batch], list(range(i, min(i + batch, len(keys)))))


async def assert_loads_exact(cache, kv, keys, target=63):
    for key in keys:
        assert await cache.load([key], [target]) == 1, key.hex()[:8]
        assert holds(kv, target, key)


async def test_write_back_spills_evicted_blocks_and_promotes_them(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=32)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(20))
        await store_all(cache, kv, keys)
        stats = cache.stats()
        assert stats["cpu"]["resident"] == 4
        assert stats["disk"]["resident"] == 16  # every evicted block went to disk first
        assert stats["metrics"]["tiered_kv_spills_total"] == 16
        res = cache.lookup(keys)
        assert res.total == 20 and res.disk == 16 and res.cpu == 4
        for t in kv.values():
            t[:32].zero_()
        await assert_loads_exact(cache, kv, keys)
        assert cache.stats()["metrics"]["tiered_kv_blocks_moved_total{disk_to_cpu}"] >= 16
        cache.check_invariants()


async def test_multi_block_load_mixes_tiers_in_one_call(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=8, disk_blocks=32)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(12))
        await store_all(cache, kv, keys)
        assert cache.lookup(keys[:6]).disk > 0
        assert await cache.load(keys[:6], [40, 41, 42, 43, 44, 45]) == 6
        assert all(holds(kv, 40 + i, keys[i]) for i in range(6))


async def test_write_through_and_restart_recovery(tmp_path, device):
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=16, disk_blocks=32, spill="write_through")
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(10))
        await store_all(cache, kv, keys)
        while cache._tasks:  # write-through spills run in the background
            await asyncio.sleep(0.001)
        assert cache.stats()["disk"]["resident"] == 10
    kv2 = make_kv(64, device)
    async with cache_for(kv2, cfg) as cache:
        assert cache.recovered_blocks == 10
        assert cache.lookup(keys).disk == 10
        await assert_loads_exact(cache, kv2, keys)


async def test_other_model_never_reads_these_blocks(tmp_path, device):
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=4, disk_blocks=32, spill="write_through")
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(6))
        await store_all(cache, kv, keys)
    other = dict(cfg, model={"bytes_per_block": 1024, "model_id": "another-model"})
    async with cache_for(make_kv(64, device), other) as cache:
        assert cache.recovered_blocks == 0
        assert cache.lookup(keys).total == 0
        assert cache.lookup(cache.keyer.keys_for_block_ids(range(6))).total == 0


async def test_flipped_bytes_on_disk_are_misses_never_data(tmp_path, device):
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=4, disk_blocks=32)
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(16))
        await store_all(cache, kv, keys)
        on_disk = {k: s for k, s in cache.manager.disk.resident().items()}
        record = cache.disk.store.record_size
        data = os.path.join(cache.disk.store.path, DATA_FILE)
    bad = [k for k in keys if k in on_disk][:3]
    with open(data, "r+b") as f:
        for key in bad:
            f.seek(on_disk[key] * record + 200)  # inside the payload
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    async with cache_for(make_kv(64, device), cfg) as cache:
        for key in keys:
            if key not in on_disk:
                continue
            got = await cache.load([key], [7])
            if key in bad:
                assert got == 0  # a miss, and the block is dropped
                assert cache.lookup([key]).total == 0
            else:
                assert got == 1
        assert cache.stats()["metrics"]["tiered_kv_corrupt_blocks_total{disk}"] == 3
    async with cache_for(make_kv(64, device), cfg) as cache:  # the dropped slots were journaled invalid
        assert [cache.lookup([key]).total for key in bad] == [0, 0, 0]


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 192 KiB tmpfs: the disk tier fills it for real (skipped where mount is refused)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k,mode=0700", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


async def test_full_disk_degrades_the_tier_and_cpu_keeps_serving(tmp_path, tiny_fs, device):
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=8, disk_blocks=200)
    cfg["tiers"]["disk"]["path"] = str(tiny_fs)
    cfg["tiers"]["disk"]["allow_overcommit"] = True  # the point is to fill it
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(60))
        await store_all(cache, kv, keys)
        stats = cache.stats()
        assert stats["disk"]["degraded"], "a full file system must degrade the disk tier"
        assert "No space" in stats["disk"]["degraded"] or "ENOSPC" in stats["disk"]["degraded"]
        assert stats["metrics"]["tiered_kv_degraded_events_total{disk}"] == 1
        on_disk = cache.manager.disk.n_ready
        assert 0 < on_disk < 52
        # CPU keeps taking stores and serving them; what reached disk still loads exact
        more = cache.keyer.keys_for_block_ids(range(100, 104))
        for i, key in enumerate(more):
            fill(kv, 60 + i, key)
        assert (await cache.store(more, [60, 61, 62, 63])).stored == 4
        await assert_loads_exact(cache, kv, more, target=59)
        await assert_loads_exact(cache, kv, [k for k in keys if k in cache.manager.disk.resident()], target=58)
        cache.check_invariants()


async def test_a_failed_read_is_a_miss_that_keeps_the_disk_blocks(tmp_path, device):
    """An I/O fault on promotion says nothing about the data: no wrong bytes, and nothing dropped."""
    kv = make_kv(64, device)
    # write-through: every CPU block is clean, so making room for a promotion writes nothing
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=32, spill="write_through")) as cache:
        keys = cache.keyer.keys_for_block_ids(range(12))
        await store_all(cache, kv, keys)
        while cache._tasks:
            await asyncio.sleep(0.001)
        assert cache.lookup(keys[:8]).disk == 8
        fd = cache.disk.store._dfd
        saved, broken = os.dup(fd), os.open(str(tmp_path), os.O_RDONLY)  # reading a directory: EISDIR
        os.dup2(broken, fd)
        try:
            for t in kv.values():
                t[40:52].zero_()
            assert await cache.load(keys[:8], list(range(40, 48))) == 0
            assert all(int(t[40:52].sum()) == 0 for t in kv.values())  # nothing wrong was written
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            os.close(broken)
        assert cache.lookup(keys[:8]).disk == 8, "a failed read dropped disk blocks it never verified"
        await assert_loads_exact(cache, kv, keys)
        cache.check_invariants()


async def test_concurrent_loads_of_one_disk_prefix_share_the_promotion(tmp_path, device):
    """After a restart, 4 concurrent loads of a 3-block disk prefix all get 3 (it was [3, 0, 0, 0])."""
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=8, disk_blocks=32, spill="write_through")
    async with cache_for(kv, cfg) as cache:
        keys = cache.keyer.keys_for_block_ids(range(3))
        await store_all(cache, kv, keys)
    async with cache_for(kv, cfg) as cache:
        assert cache.lookup(keys).disk == 3
        targets = [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
        got = await asyncio.gather(*(cache.load(keys, t) for t in targets))
        assert got == [3, 3, 3, 3]
        assert all(holds(kv, t[i], keys[i]) for t in targets for i in range(3))
        assert cache.stats()["metrics"]["tiered_kv_blocks_moved_total{disk_to_cpu}"] == 3  # read once
        cache.check_invariants()


async def test_a_disk_prefix_longer_than_the_cpu_tier_loads_whole(tmp_path, device):
    """A 12-block prefix on disk with an 8-slot CPU tier loads all 12 (it used to stop at 8)."""
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=8, disk_blocks=32)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(12))
        other = cache.keyer.keys_for_block_ids(range(100, 108))
        await store_all(cache, kv, keys)
        for i, k in enumerate(other):
            fill(kv, 20 + i, k)
        await cache.store(other, list(range(20, 28)))  # pushes the whole prefix to disk
        assert cache.lookup(keys).disk == 12
        assert await cache.load(keys, list(range(40, 52))) == 12
        assert all(holds(kv, 40 + i, k) for i, k in enumerate(keys))
        cache.check_invariants()


async def test_racing_stores_of_the_same_keys_count_in_flight_and_evict_once(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=32)) as cache:
        first = cache.keyer.keys_for_block_ids(range(4))
        await store_all(cache, kv, first)
        keys = cache.keyer.keys_for_block_ids(range(10, 15))
        for i, k in enumerate(keys):
            fill(kv, 10 + i, k)
        a, b = await asyncio.gather(cache.store(keys, list(range(10, 15))), cache.store(keys, list(range(10, 15))))
        # One store places 4 (the tier's size); the other counts those 4 in flight instead of
        # storing them again and waits. The fifth never evicts its own chain's head (that
        # would orphan it): both skip it. Each block moves once.
        assert sorted([a.in_flight, b.in_flight]) == [0, 4] and a.stored + b.stored == 4
        assert a.skipped == b.skipped == 1
        assert cache.stats()["metrics"]["tiered_kv_spills_total"] == 4  # the 4 displaced blocks, never 12
        cache.check_invariants()


async def test_a_spill_cancelled_mid_write_releases_its_slots_and_raises_the_cancel(tmp_path, device):
    # A write-through spill whose disk write is held behind the disk executor's busy threads, cancelled there:
    # it must wait for its write, then release the job's CPU slots and re-raise CancelledError (an unbound
    # ``ok`` once turned the cancel into UnboundLocalError and left the slots pinned for ever).
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=16, disk_blocks=32, spill="write_through")) as cache:
        executor = cache._res.disk.store._calls.executor
        gate = threading.Event()
        busy = [executor.submit(gate.wait, 10) for _ in range(executor._max_workers)]
        keys = cache.keyer.keys_for_block_ids(range(4))
        for i, key in enumerate(keys):
            fill(kv, i, key)
        before = set(cache._tasks)
        await cache.store(keys, [0, 1, 2, 3])  # committed to the CPU tier; its disk write waits in the background
        (spill,) = set(cache._tasks) - before
        await asyncio.sleep(0.01)
        spill.cancel()
        await asyncio.sleep(0.01)
        assert not spill.done()  # it waits for the write it started, which reads the CPU slots
        gate.set()
        await asyncio.wait([asyncio.wrap_future(f) for f in busy])
        with pytest.raises(asyncio.CancelledError):
            await spill
        cache.check_invariants()
        assert cache.manager.cpu.n_ready_pinned == 0  # the job's slots are not held by a spill nobody finishes
        assert cache.lookup(keys).cpu == 4 and await cache.load(keys, [40, 41, 42, 43]) == 4
        assert all(holds(kv, 40 + i, key) for i, key in enumerate(keys))
