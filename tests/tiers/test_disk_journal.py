"""The journal at recovery: bounded memory, compaction, crafted records (huge seq, duplicate keys), bound.

Every block recovered here is read back and compared byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tracemalloc

import numpy as np
import pytest
from disk_helpers import get, payload, put

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk.format import JCOMMIT, JREC_SIZE, jrecord

BPB = 4196
NS = DiskNamespace("journal-model", "float16", "journal-layout", BPB, 32)


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"journal%d" % i).digest()


async def write(store: DiskStore, slot: int, key: bytes) -> None:
    assert (await put(store, [slot], [key])).all()


async def assert_exact(store: DiskStore, expect: dict[int, bytes]) -> None:
    """Recovered exactly ``expect`` (slot -> key), and every block reads back byte-exact."""
    assert {r.slot: r.key for r in store.recovered} == expect
    slots = list(expect)
    assert await get(store, slots, [expect[s] for s in slots]) == [payload(expect[s], BPB) for s in slots]


def jpath(root) -> str:
    return os.path.join(root, NS.dirname(), "journal.tkv")


async def test_sparse_2gib_journal_opens_with_bounded_memory_and_is_compacted(tmp_path):
    """A 2 GiB hole between valid records: recovery streams past it, and memory stays at a few chunks."""
    async with DiskStore(tmp_path, NS, 8) as store:
        for i in range(4):
            await write(store, i, key_of(i))
        await write(store, 4, key_of(4))
    with open(jpath(tmp_path), "r+b") as f:
        f.seek(-JREC_SIZE, os.SEEK_END)
        last = f.read()  # the commit of slot 4: it goes after the hole
        size = f.seek(-JREC_SIZE, os.SEEK_END)
    os.truncate(jpath(tmp_path), size + (2 << 30))
    with open(jpath(tmp_path), "ab") as f:
        f.write(last)
    assert os.stat(jpath(tmp_path)).st_blocks * 512 < 1 << 20  # sparse: nothing allocated
    tracemalloc.start()
    try:
        store = DiskStore(tmp_path, NS, 8)
        await store.open()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    try:
        assert peak < 32 << 20, f"recovery allocated {peak / 2**20:.0f} MiB for a sparse journal"
        await assert_exact(store, {i: key_of(i) for i in range(5)})
        assert os.path.getsize(jpath(tmp_path)) == JREC_SIZE * (1 + 5)  # compacted at open
    finally:
        await store.aclose()


async def test_superseded_records_compacted_with_identical_recovery(tmp_path):
    """Many overwrites and invalidations; replayed in tiny chunks (records split across reads) and whole."""
    expect: dict[int, bytes] = {}
    store = DiskStore(tmp_path, NS, 8)
    store.compact_slack = 10**9  # never compact while writing: the journal keeps every record
    async with store:
        for i in range(300):
            slot = (i * 5) % 8
            await write(store, slot, key_of(i))
            expect[slot] = key_of(i)
            if i % 37 == 0:
                store.invalidate_many(np.array([slot]))
                expect.pop(slot)
    grown = os.path.getsize(jpath(tmp_path))
    assert grown > JREC_SIZE * 300
    small = DiskStore(tmp_path, NS, 8)
    small.compact_slack = 10**9  # replay only: keep the long journal for the second reader
    small.journal_read_chunk = 3 * JREC_SIZE + 17  # not a multiple of a record: rounded down to 3
    async with small:
        chunked = list(small.recovered)
        await assert_exact(small, expect)
    assert os.path.getsize(jpath(tmp_path)) == grown
    whole = DiskStore(tmp_path, NS, 8, fsync=True)
    whole.compact_slack = 16  # 600 records for 6 live slots: compacted at open
    async with whole:
        assert whole.recovered == chunked  # same blocks, same seqs, same oldest -> newest order
        await assert_exact(whole, expect)
    assert os.path.getsize(jpath(tmp_path)) == JREC_SIZE * (1 + len(expect))  # only live commits left
    async with DiskStore(tmp_path, NS, 8) as again:
        assert again.recovered == chunked


async def test_record_with_seq_2_64_minus_1_is_skipped_and_writes_go_on(tmp_path, caplog):
    async with DiskStore(tmp_path, NS, 8) as store:
        for i in range(3):
            await write(store, i, key_of(i))
    with open(jpath(tmp_path), "ab") as f:  # checksum-valid, for slot 5, with no room for a next seq
        f.write(jrecord(JCOMMIT, 5, 2**64 - 1, key_of(99), 0))
    caplog.set_level(logging.WARNING, "tiered_kv")
    async with DiskStore(tmp_path, NS, 8) as store:
        await assert_exact(store, {i: key_of(i) for i in range(3)})
        assert "journal_bad_seq" in caplog.text and "2**63" in caplog.text
        for i in range(3, 6):  # writes after it work (they used to fail with struct.error)
            await write(store, i, key_of(i))
    async with DiskStore(tmp_path, NS, 8) as store:
        await assert_exact(store, {i: key_of(i) for i in range(6)})
        assert max(r.seq for r in store.recovered) < 2**63


@pytest.mark.parametrize("same_seq", [False, True])
async def test_duplicate_key_commits_resolve_to_the_higher_seq(tmp_path, caplog, same_seq):
    key = key_of(7)
    async with DiskStore(tmp_path, NS, 8) as store:
        await write(store, 0, key_of(0))
        await write(store, 2, key)
        await write(store, 6, key)  # the store itself does not dedupe: the index does
        seq6 = store._seq
    if same_seq:  # crafted: a commit of the same seq for slot 2 (ties go to the higher slot)
        with open(jpath(tmp_path), "ab") as f:
            with open(os.path.join(tmp_path, NS.dirname(), "journal.tkv"), "rb") as j:
                psum = int.from_bytes(j.read()[-JREC_SIZE:][16:24], "little")
            f.write(jrecord(JCOMMIT, 2, seq6, key, psum))
    caplog.set_level(logging.WARNING, "tiered_kv")
    async with DiskStore(tmp_path, NS, 8) as store:
        await assert_exact(store, {0: key_of(0), 6: key})
        assert "journal_duplicate_key" in caplog.text
    async with DiskStore(tmp_path, NS, 8) as store:  # resolved for good by the compaction
        await assert_exact(store, {0: key_of(0), 6: key})
    assert os.path.getsize(jpath(tmp_path)) == JREC_SIZE * 3


async def test_journal_bound_stops_writes_when_compaction_keeps_failing(tmp_path):
    store = DiskStore(tmp_path, NS, 4)
    store.compact_slack = 4
    store.journal_floor = 64 * JREC_SIZE
    async with store:
        os.mkdir(jpath(tmp_path) + ".tmp")  # blocks every compaction (EISDIR)
        with pytest.raises(DiskError) as ei:
            for i in range(200):
                await write(store, i % 4, key_of(i))
        assert "bound" in str(ei.value) and str(64 * JREC_SIZE) in str(ei.value)
        assert os.path.getsize(jpath(tmp_path)) <= 64 * JREC_SIZE
        written = i
        os.rmdir(jpath(tmp_path) + ".tmp")
        await write(store, 0, key_of(1000))  # compacts, then goes on
        assert os.path.getsize(jpath(tmp_path)) < 16 * JREC_SIZE
    async with DiskStore(tmp_path, NS, 4) as store:
        expect = {j % 4: key_of(j) for j in range(written)}  # the failed write's slot may be gone
        expect[0] = key_of(1000)
        assert {r.slot: r.key for r in store.recovered}[0] == key_of(1000)
        for r in store.recovered:  # whatever was committed reads back exact
            assert r.key == expect[r.slot]
        assert await get(store, [r.slot for r in store.recovered], [r.key for r in store.recovered]) == [
            payload(r.key, BPB) for r in store.recovered]
    assert ei.value.errno == errno.EISDIR
