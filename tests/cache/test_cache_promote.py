"""TieredKVCache.promote: disk blocks read into CPU slots without a GPU copy (issue 39 item 3)."""

from __future__ import annotations

import os

import pytest
from cache_helpers import cache_for, config, fill, holds, make_kv

from tiered_kv.tiers.disk.format import DATA_FILE


async def stored_on_disk(cache, kv, n):
    keys = cache.keyer.keys_for_block_ids(range(n))
    for i, key in enumerate(keys):
        fill(kv, i, key)
    for i in range(0, n, 4):
        await cache.store(keys[i : i + 4], list(range(i, min(i + 4, n))))
    return keys


async def test_promote_reads_disk_blocks_into_the_cpu_tier_and_copies_nothing_to_the_gpu(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=8, disk_blocks=32)) as cache:
        keys = await stored_on_disk(cache, kv, 20)
        head = keys[:6]
        assert cache.lookup(head).cpu == 0 and cache.lookup(head).disk == 6
        for t in kv.values():
            t[:32].zero_()
        zeroed = {k: t.clone() for k, t in kv.items()}
        assert await cache.promote(head) == 6
        assert all(t.equal(zeroed[k]) for k, t in kv.items())  # no GPU block written
        res = cache.lookup(head)
        assert res.cpu == 6 and res.disk == 0
        # Now a CPU hit: the bytes that come out are the stored ones.
        assert await cache.load(head, list(range(40, 46))) == 6
        assert all(holds(kv, 40 + i, key) for i, key in enumerate(head))
        cache.check_invariants()
        assert cache.manager.cpu.n_ready_pinned == 0  # the promotion holds no pin once it returned


async def test_promote_of_cpu_hits_and_misses_counts_the_leading_cpu_run(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=8, disk_blocks=32)) as cache:
        keys = await stored_on_disk(cache, kv, 4)  # all four still in the CPU tier
        missing = cache.keyer.keys_for_block_ids(range(50, 52))
        assert await cache.promote(keys + missing) == 4
        assert await cache.promote(missing) == 0
        cache.check_invariants()


async def test_promote_is_bounded_by_the_cpu_tier(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=32)) as cache:
        keys = await stored_on_disk(cache, kv, 12)
        assert await cache.promote(keys[:10]) == 4  # at most the tier's slots, the run's head
        assert cache.lookup(keys[:10]).cpu == 4
        cache.check_invariants()


async def test_a_corrupt_disk_record_stops_the_promoted_run_there(tmp_path, device):
    kv = make_kv(64, device)
    cfg = config(tmp_path, cpu_blocks=4, disk_blocks=32)
    async with cache_for(kv, cfg) as cache:
        keys = await stored_on_disk(cache, kv, 12)
        on_disk = dict(cache.manager.disk.resident())
        record = cache.disk.store.record_size
        data = os.path.join(cache.disk.store.path, DATA_FILE)
    run = keys[:4]
    assert all(k in on_disk for k in run)
    with open(data, "r+b") as f:  # flip a byte inside the payload of the run's third block
        f.seek(on_disk[run[2]] * record + 200)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    async with cache_for(make_kv(64, device), cfg) as cache:
        assert await cache.promote(run) == 2  # the run ends at the bad block, which is dropped
        assert cache.lookup(run).total == 2
        cache.check_invariants()


async def test_promote_of_nothing_and_of_bad_keys(tmp_path, device):
    kv = make_kv(64, device)
    async with cache_for(kv, config(tmp_path, cpu_blocks=4, disk_blocks=8)) as cache:
        assert await cache.promote([]) == 0
        with pytest.raises(Exception, match="key"):
            await cache.promote([b"short"])
