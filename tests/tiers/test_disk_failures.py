"""Disk failures stay confined to the block that caused them, or degrade the tier (metric + ONE WARNING).

Also recovery oddities through a real TieredKVCache: a duplicate-key commit and a commit whose seq
leaves no room; both open cleanly, count what they dropped, keep writing, and serve exact bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading

import numpy as np
import pytest
import torch
from disk_helpers import get, key_rows, payload, slab_of

import tiered_kv as tkv
from tiered_kv.errors import KeyFormatError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk.format import JCOMMIT, JREC_SIZE, jrecord

BLOCK = 1024


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"fail%d" % i).digest()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tiered_kv")]


async def test_a_batch_with_bad_keys_fails_alone(tmp_path):
    """Five concurrent batches; the one whose keys are 20 bytes wide is refused whole, the others land."""
    ns = DiskNamespace("fail-model", "uint8", "fail-layout", BLOCK, 32)
    keys = [key_of(i) for i in range(40)]
    slab = slab_of(keys, BLOCK)
    batches = [np.arange(i, 40, 5) for i in range(5)]
    async with DiskStore(tmp_path, ns, 64) as store:
        rows = [key_rows([keys[j] for j in b]) for b in batches]
        rows[2] = rows[2][:, :20]
        res = await asyncio.gather(*(store.write_many(b, r, slab, b) for b, r in zip(batches, rows, strict=True)),
                                   return_exceptions=True)
        assert isinstance(res[2], KeyFormatError) and "[8, 32]" in str(res[2])
        assert all(res[i].all() for i in (0, 1, 3, 4))
        good = [j for i in (0, 1, 3, 4) for j in batches[i].tolist()]
        assert await get(store, good, [keys[j] for j in good]) == [payload(keys[j], BLOCK) for j in good]
    async with DiskStore(tmp_path, ns, 64) as store:
        assert sorted(r.slot for r in store.recovered) == sorted(good)


# ---- through a real cache ----------------------------------------------------------------------------
def cfg_dict(path) -> dict:
    return {
        "model": {"model_id": "fail-test-model", "bytes_per_block": BLOCK},
        "gpu": {"num_blocks": 64},
        "tiers": {
            "cpu": {"capacity": 16 * BLOCK, "pin_memory": "off"},
            "disk": {"enabled": True, "path": str(path), "capacity": 64 * BLOCK, "spill_policy": "write_through"},
        },
    }


def make_kv() -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(64, 768, dtype=torch.uint8), "v": torch.zeros(64, 256, dtype=torch.uint8)}


def fill(kv, gid: int, key: bytes) -> None:
    data = hashlib.shake_128(key).digest(BLOCK)
    kv["k"][gid] = torch.frombuffer(bytearray(data[:768]), dtype=torch.uint8)
    kv["v"][gid] = torch.frombuffer(bytearray(data[768:]), dtype=torch.uint8)


def holds(kv, gid: int, key: bytes) -> bool:
    return bytes(kv["k"][gid].numpy()) + bytes(kv["v"][gid].numpy()) == hashlib.shake_128(key).digest(BLOCK)


def cache_for(kv, path) -> tkv.TieredKVCache:
    return tkv.TieredKVCache(cfg_dict(path), tkv.KVLayout.from_tensors(kv, 64))


async def settle(cache) -> None:
    while cache._tasks:  # write-through spills run in the background
        await asyncio.sleep(0.001)


async def store_blocks(cache, kv, ids: range) -> list[bytes]:
    keys = cache.keyer.keys_for_block_ids(ids)
    for gid, key in zip(range(len(keys)), keys, strict=True):
        fill(kv, gid, key)
    await cache.store(keys, list(range(len(keys))))
    await settle(cache)
    return keys


async def store_on_disk(path, n: int) -> tuple[list[bytes], DiskStore]:
    """n blocks written through to disk by a real cache; the keys and an unopened store on that dir."""
    kv = make_kv()
    async with cache_for(kv, path) as cache:
        keys = await store_blocks(cache, kv, range(n))
        assert cache.stats()["disk"]["resident"] == n
        s = cache.disk.store
        return keys, DiskStore(s.root, s.namespace, s.num_slots)


async def assert_serves_exact(path, keys: list[bytes], cause: str) -> None:
    kv = make_kv()
    async with cache_for(kv, path) as cache:
        assert cache.recovered_blocks == len(keys)
        assert cache.lookup(keys).disk == len(keys)
        for key in keys:
            assert await cache.load([key], [40]) == 1 and holds(kv, 40, key)
        snap = cache.stats()["metrics"]
        assert snap[f"tiered_kv_dropped_blocks_total{{disk,{cause}}}"] == 1
        assert snap["tiered_kv_degraded_events_total{disk}"] == 0
        await store_blocks(cache, kv, range(100, 104))  # writes go on after recovery
        assert cache.stats()["disk"]["resident"] == len(keys) + 4 and not cache.stats()["disk"]["degraded"]
        cache.check_invariants()


async def test_duplicate_key_commit_opens_and_keeps_the_newer_slot(tmp_path, caplog):
    keys, store = await store_on_disk(tmp_path, 4)
    async with store:  # the same key written again at another slot: two live commits for one key
        old = {r.key: r.slot for r in store.recovered}[keys[0]]
        slab, one = np.zeros((1, BLOCK), np.uint8), np.zeros(1, np.int64)
        assert (await store.read_many(np.array([old]), key_rows(keys[:1]), slab, one)).all()
        assert (await store.write_many(np.array([old + 20]), key_rows(keys[:1]), slab, one)).all()
    caplog.set_level(logging.WARNING, "tiered_kv")
    await assert_serves_exact(tmp_path, keys, "journal_duplicate_key")
    assert len([w for w in warnings_of(caplog) if "journal_duplicate_key" in w]) == 1
    async with DiskStore(store.root, store.namespace, store.num_slots) as again:
        assert {r.key: r.slot for r in again.recovered}[keys[0]] == old + 20


async def test_commit_with_exhausted_seq_is_skipped_and_the_tier_stays_writable(tmp_path):
    keys, store = await store_on_disk(tmp_path, 4)
    jpath = os.path.join(store.path, "journal.tkv")
    with open(jpath, "ab") as f:  # a checksum-valid commit at slot 30 with seq 2**64 - 1
        f.write(jrecord(JCOMMIT, 30, 2**64 - 1, hashlib.sha256(b"planted").digest(), 0))
    assert os.path.getsize(jpath) % JREC_SIZE == 0
    await assert_serves_exact(tmp_path, keys, "journal_bad_seq")


async def test_enospc_in_a_live_cache_degrades_with_one_warning(tmp_path, caplog):
    """/dev/full dup2'ed over the data file: a burst of spills fails; one WARNING, one event, CPU serves."""
    caplog.set_level(logging.DEBUG, "tiered_kv")
    kv = make_kv()
    async with cache_for(kv, tmp_path) as cache:
        fd = cache.disk.store._dfd
        saved, full = os.dup(fd), os.open("/dev/full", os.O_RDWR)
        os.dup2(full, fd)
        try:
            keys = await store_blocks(cache, kv, range(12))
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            os.close(full)
        stats = cache.stats()
        assert stats["disk"]["degraded"] and "No space" in stats["disk"]["degraded"]
        assert stats["metrics"]["tiered_kv_degraded_events_total{disk}"] == 1
        assert len(warnings_of(caplog)) == 1 and "degraded" in warnings_of(caplog)[0], warnings_of(caplog)
        for key in keys:  # CPU goes on serving
            assert await cache.load([key], [40]) == 1 and holds(kv, 40, key)
        cache.check_invariants()


@pytest.mark.parametrize("attempts", [2])
async def test_failed_start_leaves_nothing_held(tmp_path, attempts):
    """A start() that fails in the disk tier gives back its fds and threads; fixing the cause is enough."""
    keys, store = await store_on_disk(tmp_path, 2)
    jpath = os.path.join(store.path, "journal.tkv")
    os.rename(jpath, jpath + ".saved")
    os.mkfifo(jpath, 0o600)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(attempts):
        with pytest.raises(tkv.DiskError, match="regular file"):
            async with cache_for(make_kv(), tmp_path):
                pass
        assert len(os.listdir("/proc/self/fd")) == fds
        assert not [t for t in threading.enumerate() if t.name.startswith("tkv-disk")]
    os.unlink(jpath)
    os.rename(jpath + ".saved", jpath)
    async with cache_for(make_kv(), tmp_path) as cache:
        assert cache.recovered_blocks == 2 and cache.lookup(keys).disk == 2
