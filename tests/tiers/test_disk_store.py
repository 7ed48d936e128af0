"""DiskStore: round trips, recovery, namespaces, corruption, compaction, bad arguments, cancelled writes.

Everything runs on real files under tmp_path (file-system faults: test_disk_store_fs.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil

import numpy as np
import pytest
from disk_helpers import get, key_rows, put, slab_of
from store_helpers import BPB, NS, key_of, payload, read_bytes, write

from tiered_kv.errors import ConfigError, DiskError, KeyFormatError, LayoutError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk.format import HEADER_SIZE, JREC_SIZE


async def test_round_trip_many_blocks_in_concurrent_batches(tmp_path):
    n = 200
    keys = [key_of(i) for i in range(n)]
    slab = slab_of(keys, BPB)  # like the CPU slab: one row per block
    async with DiskStore(tmp_path, NS, n) as store:
        rows = np.random.default_rng(3).permutation(n)  # disk slot i <- slab row rows[i]
        batches = [np.arange(i, n, 8) for i in range(8)]  # 8 concurrent batches, none with adjacent slots
        oks = await asyncio.gather(*(store.write_many(b, key_rows([keys[r] for r in rows[b]]), slab, rows[b])
                                     for b in batches))
        assert all(ok.all() for ok in oks)
        assert store.write_syscalls == n  # no two slots of a batch are adjacent: one run per block
        out = np.zeros_like(slab)
        order = np.random.default_rng(4).permutation(n)  # read back in another order into other rows
        ok = await store.read_many(order, key_rows([keys[rows[i]] for i in order]), out, np.arange(n))
        assert ok.all() and np.array_equal(out, slab[rows[order]])
        assert store.read_syscalls == 1  # every slot 0..199: one run
        assert (store.writes, store.reads, store.corrupt_blocks) == (n, n, 0)
        assert store.bytes_written == store.bytes_read == n * BPB


async def test_overwrite_slot_and_invalidate(tmp_path):
    a, b, c = key_of(1), key_of(2), key_of(3)
    async with DiskStore(tmp_path, NS, 8) as store:
        await write(store, 5, a)
        await write(store, 5, b)
        assert await read_bytes(store, 5, b) == payload(b)
        assert await read_bytes(store, 5, a) is None  # the old key no longer verifies
        assert store.corrupt_blocks == 1
        await write(store, 6, c)
        store.invalidate_many(np.array([6]))
        assert await read_bytes(store, 6, c) == payload(c)  # invalidate forgets for recovery, not the bytes
    async with DiskStore(tmp_path, NS, 8) as store:
        assert [(r.key, r.slot) for r in store.recovered] == [(b, 5)]


async def test_invalidate_reaches_the_journal_at_flush(tmp_path):
    """Copy the directory while the store is open: what a crash at that moment would leave behind."""
    async with DiskStore(tmp_path / "live", NS, 4) as store:
        await write(store, 1, key_of(1))
        await write(store, 2, key_of(2))
        store.invalidate_many(np.array([1]))
        shutil.copytree(store.path, tmp_path / "before" / NS.dirname())
        await store.flush()
        shutil.copytree(store.path, tmp_path / "after" / NS.dirname())
    async with DiskStore(tmp_path / "before", NS, 4) as st:  # queued only: still offered, intact
        assert sorted(r.slot for r in st.recovered) == [1, 2]
        assert await read_bytes(st, 1, key_of(1)) == payload(key_of(1))
    async with DiskStore(tmp_path / "after", NS, 4) as st:
        assert [r.slot for r in st.recovered] == [2]


async def test_restart_recovers_latest_per_slot_in_seq_order(tmp_path):
    expect = {}
    async with DiskStore(tmp_path, NS, 16) as store:
        for i in range(40):
            slot = (i * 7) % 16
            await write(store, slot, key_of(i))
            expect[slot] = key_of(i)
    async with DiskStore(tmp_path, NS, 16) as store:
        rec = store.recovered
        assert {r.slot: r.key for r in rec} == expect
        seqs = [r.seq for r in rec]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        order = [r.key for r in rec]  # oldest -> newest: the write order of the surviving keys
        assert order == sorted(order, key=lambda k: [key_of(i) for i in range(40)].index(k))
        for r in rec:
            assert await read_bytes(store, r.slot, r.key) == payload(r.key)
        await write(store, 0, key_of(99))  # seq continues after the recovered ones
    async with DiskStore(tmp_path, NS, 16) as store:
        assert store.recovered[-1].key == key_of(99) and store.recovered[-1].seq > max(seqs)


@pytest.mark.parametrize("field,value", [("layout_digest", "layout-2"), ("model_id", "model-b"), ("dtype", "bf16")])
async def test_namespace_isolation(tmp_path, field, value):
    other = DiskNamespace(**{**NS.__dict__, field: value})
    assert other.dirname() != NS.dirname() and len(other.dirname()) == len(NS.dirname()) == 23
    async with DiskStore(tmp_path, NS, 4) as store:
        await write(store, 0, key_of(0))
    async with DiskStore(tmp_path, other, 4) as store:
        assert store.recovered == []
        assert await read_bytes(store, 0, key_of(0)) is None
    async with DiskStore(tmp_path, NS, 4) as store:
        assert len(store.recovered) == 1


def test_dirname_is_never_raw_user_text():
    evil = DiskNamespace("../../etc/passwd", "x/y", "..", 10, 16)
    assert evil.dirname().startswith("ns-") and all(c in "0123456789abcdef" for c in evil.dirname()[3:])


async def test_namespace_json_mismatch_refused(tmp_path):
    async with DiskStore(tmp_path, NS, 4):
        pass
    nsfile = tmp_path / NS.dirname() / "namespace.json"
    doc = json.loads(nsfile.read_text())
    nsfile.write_text(json.dumps({**doc, "model_id": "someone-else"}))
    with pytest.raises(DiskError, match="disagrees") as ei:
        await DiskStore(tmp_path, NS, 4).open()
    assert "model_id" in str(ei.value)
    nsfile.write_text("{not json")
    with pytest.raises(DiskError, match="namespace.json"):
        await DiskStore(tmp_path, NS, 4).open()


async def test_smaller_num_slots_drops_out_of_range(tmp_path):
    async with DiskStore(tmp_path, NS, 20) as store:
        for i in range(20):
            await write(store, i, key_of(i))
    async with DiskStore(tmp_path, NS, 10) as store:
        assert sorted(r.slot for r in store.recovered) == list(range(10))
        assert os.path.getsize(os.path.join(store.path, "blocks.dat")) == 10 * store.record_size
        for r in store.recovered:
            assert await read_bytes(store, r.slot, r.key) == payload(r.key)
    async with DiskStore(tmp_path, NS, 20) as store:  # dropped entries do not come back
        assert sorted(r.slot for r in store.recovered) == list(range(10))


async def test_corruption_detected_exactly(tmp_path, caplog):
    n = 12
    async with DiskStore(tmp_path, NS, n) as store:
        assert (await put(store, range(n), [key_of(i) for i in range(n)])).all()  # one run
        rs = store.record_size
        data = os.path.join(store.path, "blocks.dat")
    flips = {2: HEADER_SIZE + 10, 4: HEADER_SIZE + BPB - 1, 6: 40, 8: 4, 9: HEADER_SIZE - 3}  # payload, header
    with open(data, "r+b") as f:
        for slot, off in flips.items():
            f.seek(slot * rs + off)
            b = f.read(1)
            f.seek(slot * rs + off)
            f.write(bytes([b[0] ^ 0x55]))
    async with DiskStore(tmp_path, NS, n) as store:
        assert len(store.recovered) == n  # the journal is fine; reads catch the damage
        os.truncate(data, (n - 1) * rs + HEADER_SIZE + 100)  # cut the last record while open: a short read
        caplog.set_level(logging.WARNING, "tiered_kv.disk")
        got = await get(store, range(n), [key_of(i) for i in range(n)])  # one run, checked record by record
        bad = {i for i in range(n) if got[i] is None}
        assert bad == set(flips) | {n - 1}
        assert all(got[i] == payload(key_of(i)) for i in range(n) if i not in bad)
        assert store.corrupt_blocks == len(bad) and store.read_syscalls == 1
        assert "short read" in caplog.text and "checksum" in caplog.text


async def test_torn_and_corrupt_journal_records_skipped_and_compacted(tmp_path):
    async with DiskStore(tmp_path, NS, 8) as store:
        for i in range(8):
            await write(store, i, key_of(i))
    jpath = tmp_path / NS.dirname() / "journal.tkv"
    raw = bytearray(jpath.read_bytes())
    raw[JREC_SIZE * 3 + 30] ^= 0xFF  # corrupt the commit of slot 2 (records: header, then slot 0, 1, 2...)
    jpath.write_bytes(bytes(raw) + b"\x01" * 40)  # plus a torn tail
    async with DiskStore(tmp_path, NS, 8) as store:
        assert sorted(r.slot for r in store.recovered) == [0, 1, 3, 4, 5, 6, 7]
        assert jpath.stat().st_size == JREC_SIZE * 8  # compacted: header + 7 commits
        await write(store, 2, key_of(2))
    async with DiskStore(tmp_path, NS, 8) as store:
        assert len(store.recovered) == 8


async def test_journal_compacts_while_running(tmp_path):
    store = DiskStore(tmp_path, NS, 4)
    store.compact_slack = 10
    async with store:
        for i in range(200):
            await write(store, i % 4, key_of(i))
            assert os.path.getsize(os.path.join(store.path, "journal.tkv")) <= JREC_SIZE * (1 + 2 * 4 + 10 + 2)
    async with DiskStore(tmp_path, NS, 4) as store:
        assert {r.slot: r.key for r in store.recovered} == {i % 4: key_of(i) for i in range(196, 200)}


async def test_failed_compaction_does_not_fail_writes(tmp_path):
    """Compaction's temp file is blocked by a directory of that name (EISDIR): writes go on, journal grows."""
    store = DiskStore(tmp_path, NS, 4)
    store.compact_slack = 4
    jpath = os.path.join(store.path, "journal.tkv")
    async with store:
        os.mkdir(jpath + ".tmp")
        for i in range(40):
            await write(store, i % 4, key_of(i))
        grown = os.path.getsize(jpath)
        assert grown > JREC_SIZE * (1 + 2 * 4 + 4 + 2)
        os.rmdir(jpath + ".tmp")
        for i in range(40, 200):
            await write(store, i % 4, key_of(i))
        assert os.path.getsize(jpath) < grown  # retried later, and this time it worked
    async with DiskStore(tmp_path, NS, 4) as store:
        assert {r.slot: r.key for r in store.recovered} == {i % 4: key_of(i) for i in range(196, 200)}


async def test_bad_arguments_are_typed_errors(tmp_path):
    with pytest.raises(LayoutError, match="sum to bytes_per_block"):
        DiskStore(tmp_path, NS, 4, [4096, 1000])
    with pytest.raises(ConfigError, match="hash_threads must be >= 0"):
        DiskStore(tmp_path, NS, 4, hash_threads=-1)
    store = DiskStore(tmp_path, NS, 4)
    with pytest.raises(DiskError, match="not open"):
        await write(store, 0, key_of(0))
    keys = key_rows([key_of(0), key_of(1)])
    slab = slab_of([key_of(0), key_of(1)], BPB)
    two = np.arange(2)
    async with store:
        with pytest.raises(LayoutError, match=r"slot 4 out of range \[0, 4\)"):
            await write(store, 4, key_of(0))
        with pytest.raises(LayoutError, match=r"cpu_slots: slot 2 out of range \[0, 2\)"):
            await store.write_many(two, keys, slab, np.array([0, 2]))
        with pytest.raises(KeyFormatError, match=r"uint8 \[2, 32\]"):
            await store.write_many(two, keys[:, :16], slab, two)
        with pytest.raises(LayoutError, match="distinct"):
            await store.write_many(np.array([1, 1]), keys, slab, two)
        with pytest.raises(LayoutError, match="distinct"):
            await store.read_many(two, keys, slab, np.array([0, 0]))
        with pytest.raises(LayoutError, match="2 disk slots but 1 cpu slots"):
            await store.write_many(two, keys, slab, two[:1])
        with pytest.raises(LayoutError, match=f"uint8 \\[rows, {BPB}\\]"):
            await store.write_many(two, keys, slab[:, :-1].copy(), two)
        with pytest.raises(LayoutError, match="C-contiguous"):
            await store.write_many(two, keys, np.zeros((4, BPB), np.uint8)[::2], two)
        with pytest.raises(LayoutError, match="integer"):
            await store.write_many(two.astype(float), keys, slab, two)
        ro = slab.copy()
        ro.flags.writeable = False
        with pytest.raises(LayoutError, match="read-only"):
            await store.read_many(two, keys, ro, two)
        assert store.writes == 0 and store.journal_appends == 0  # nothing reached the disk
        assert (await store.write_many(two[:0], keys[:0], slab, two[:0])).shape == (0,)  # empty is fine
        assert (await store.read_many(two[:0], keys[:0], slab, two[:0])).shape == (0,)
    await store.aclose()  # idempotent
    with pytest.raises(DiskError):
        await read_bytes(store, 0, key_of(0))


async def test_cancelled_write_finishes_before_slot_is_free(tmp_path):
    async with DiskStore(tmp_path, NS, 4, io_threads=1) as store:
        tasks = [asyncio.create_task(write(store, i, key_of(i))) for i in range(4)]
        await asyncio.sleep(0)
        tasks[3].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[3], asyncio.CancelledError)
        assert not store._writing.any()
        await write(store, 3, key_of(33))
        assert await read_bytes(store, 3, key_of(33)) == payload(key_of(33))


async def test_a_slot_with_a_write_in_flight_is_false_not_an_error(tmp_path):
    keys = [key_of(i) for i in range(4)]
    async with DiskStore(tmp_path, NS, 4, io_threads=2) as store:
        first = asyncio.create_task(put(store, [0, 1], keys[:2]))
        await asyncio.sleep(0)  # the first batch holds slots 0 and 1
        ok = await put(store, [1, 2, 3], [key_of(9), keys[2], keys[3]])
        assert ok.tolist() == [False, True, True]
        assert (await first).all()
        assert await get(store, range(4), keys) == [payload(k) for k in keys]
