"""The batch API of DiskStore: one vectored syscall per run of consecutive disk slots, one journal append
per kind per batch, records verified one by one, O_DIRECT through bounce buffers. Real files throughout;
syscalls are counted by the store itself (``write_syscalls`` / ``read_syscalls`` / ``journal_appends``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import tempfile

import numpy as np
import pytest
import xxhash
from disk_helpers import get, key_rows, payload, put, slab_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk import records as records_mod
from tiered_kv.tiers.disk.format import HEADER_SIZE, encode_headers
from tiered_kv.tiers.disk.records import IOV_MAX, find_runs

BPB = 3 * 4096 + 100  # records carry padding, so the "gap" iovecs hold pad + header
NS = DiskNamespace("batch-model", "float16", "batch-layout", BPB, 32)


def key_of(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"batch{salt}{i}".encode()).digest()


def flip(store: DiskStore, slot: int, offset: int) -> None:
    with open(os.path.join(store.path, "blocks.dat"), "r+b") as f:
        f.seek(slot * store.record_size + offset)
        b = f.read(1)
        f.seek(slot * store.record_size + offset)
        f.write(bytes([b[0] ^ 0x5A]))


async def test_64_blocks_over_3_runs_take_3_pwritev_and_one_commit_append(tmp_path):
    slots = np.r_[np.arange(3, 23), np.arange(40, 64), np.arange(100, 120)]  # 20 + 24 + 20 = 64 blocks
    keys = [key_of(i) for i in range(64)]
    shuffled = np.random.default_rng(0).permutation(64)  # call order is not slot order
    async with DiskStore(tmp_path, NS, 128) as store:
        slab = slab_of(keys, BPB)
        ok = await store.write_many(slots[shuffled], key_rows([keys[i] for i in shuffled]), slab, shuffled)
        assert ok.all()
        assert store.write_syscalls == 3
        assert store.journal_appends == 1  # fresh slots: no invalidations, one append of 64 commits
        assert await get(store, slots, keys) == [payload(k, BPB) for k in keys]
        assert store.read_syscalls == 3
        # Overwriting the same slots: one append of invalidations, then one of commits.
        new = [key_of(i, "new") for i in range(64)]
        assert (await put(store, slots, new)).all()
        assert (store.write_syscalls, store.journal_appends) == (6, 3)
        assert await get(store, slots, new) == [payload(k, BPB) for k in new]
    async with DiskStore(tmp_path, NS, 128) as store:  # seq order of a batch = its call order
        assert [r.key for r in store.recovered] == new


async def test_a_run_longer_than_iov_max_is_split(tmp_path):
    ns = DiskNamespace("batch-model", "float16", "iov-layout", 64, 32)  # 64-byte blocks in 4 KiB records
    n = IOV_MAX + 100  # two iovecs per record: 511 records fit one pwritev
    keys = [key_of(i) for i in range(n)]
    async with DiskStore(tmp_path, ns, n) as store:
        assert (await put(store, range(n), keys)).all()
        assert store.write_syscalls == -(-n // ((IOV_MAX - 1) // 2)) == 3
        assert await get(store, range(n), keys) == [payload(k, 64) for k in keys]
        assert store.read_syscalls == 3


def test_find_runs():
    assert find_runs(np.array([], np.int64), 4) == []
    assert find_runs(np.array([1, 2, 3, 5, 6, 9]), 4) == [(0, 3), (3, 5), (5, 6)]
    assert find_runs(np.arange(10), 4) == [(0, 4), (4, 8), (8, 10)]
    assert find_runs(np.array([2, 2, 3]), 4) == [(0, 1), (1, 3)]  # a repeat starts a new run


def test_batch_headers_are_byte_for_byte_the_struct_layout():
    rng = np.random.default_rng(5)
    for kb in (16, 32):
        keys = rng.integers(0, 256, (3, kb), dtype=np.uint8)
        slots, seqs, psums = np.array([0, 7, 2**32 - 1]), np.array([1, 2**40, 2**63 - 1]), rng.integers(0, 2**63, 3)
        rows = encode_headers(slots, keys, BPB, seqs, psums)
        for i in range(3):
            body = struct.pack("<4sHBBIIQQQ32s48x", b"TKVB", 1, kb, 0, int(slots[i]), 0, BPB, int(seqs[i]),
                               int(psums[i]), keys[i].tobytes())
            assert rows[i].tobytes() == body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


# ---- round trips over random slot patterns, with one corrupted record ------------------------------------
NSLOTS = 48


@st.composite
def batches(draw):
    slots = draw(st.lists(st.integers(0, NSLOTS - 1), min_size=1, max_size=NSLOTS, unique=True))
    rows = draw(st.permutations(list(range(len(slots)))))
    victim = draw(st.integers(0, len(slots) - 1))
    where = draw(st.sampled_from(["payload", "header", "last byte"]))
    return slots, rows, victim, where


async def _round_trip(root: str, slots: list[int], rows: list[int], victim: int, where: str,
                      direct: bool) -> None:  # fmt: skip
    keys = [key_of(s, root) for s in slots]
    slab = np.zeros((len(slots), BPB), np.uint8)
    slab[rows] = slab_of(keys, BPB)  # key i's bytes live in slab row rows[i]
    async with DiskStore(root, NS, NSLOTS, o_direct=direct) as store:
        assert (await store.write_many(np.array(slots), key_rows(keys), slab, np.array(rows))).all()
        order = sorted(range(len(slots)), key=lambda i: slots[i], reverse=True)  # read in another order
        out = np.zeros_like(slab)
        ok = await store.read_many(np.array(slots)[order], key_rows([keys[i] for i in order]), out, np.arange(len(slots)))
        assert ok.all() and np.array_equal(out, slab[np.array(rows)[order]])
        offset = {"payload": HEADER_SIZE + BPB // 2, "header": 50, "last byte": HEADER_SIZE + BPB - 1}[where]
        flip(store, slots[victim], offset)
        got = await get(store, slots, keys)
        assert [i for i, g in enumerate(got) if g is None] == [victim]  # only that block, whatever its run
        assert all(g == payload(keys[i], BPB) for i, g in enumerate(got) if i != victim)
        assert store.corrupt_blocks == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_slot_patterns_round_trip_and_a_corrupted_record_fails_alone(batch):
    with tempfile.TemporaryDirectory() as root:
        asyncio.run(_round_trip(root, *batch, direct=False))


async def test_corrupted_record_in_the_middle_of_a_run_fails_alone(tmp_path):
    """The deterministic case of the property above: slot 10 of the run 8..12."""
    await _round_trip(str(tmp_path), [8, 9, 10, 11, 12, 30], [5, 4, 3, 2, 1, 0], 2, "payload", direct=False)


@pytest.mark.parametrize("bounce_records", [1, 3, 64])
async def test_o_direct_batches_go_through_bounce_buffers(tmp_path, monkeypatch, bounce_records):
    rs = NS.record_size
    monkeypatch.setattr(records_mod, "BOUNCE_BYTES", bounce_records * rs)
    slots = [0, 1, 2, 3, 4, 5, 6, 20, 21, 40]
    async with DiskStore(tmp_path, NS, NSLOTS, o_direct=True) as store:
        if not store.o_direct_active:
            pytest.skip(f"O_DIRECT unusable here: {store.o_direct_reason}")
        await _round_trip(str(tmp_path / "rt"), slots, list(range(10))[::-1], 3, "payload", direct=True)
        keys = [key_of(s) for s in slots]
        assert (await put(store, slots, keys)).all()
        runs = [-(-n // bounce_records) for n in (7, 2, 1)]  # each run in bounce-sized pieces
        assert store.write_syscalls == sum(runs)
        assert await get(store, slots, keys) == [payload(k, BPB) for k in keys]
        assert store.read_syscalls == sum(runs)
    async with DiskStore(tmp_path, NS, NSLOTS) as store:  # buffered reopen reads what O_DIRECT wrote
        assert await get(store, slots, keys) == [payload(k, BPB) for k in keys]


async def test_a_record_copied_to_another_slot_or_asked_for_another_key_is_refused(tmp_path, caplog):
    keys = [key_of(i) for i in range(4)]
    async with DiskStore(tmp_path, NS, 8) as store:
        assert (await put(store, range(4), keys)).all()
        rs = store.record_size
        with open(os.path.join(store.path, "blocks.dat"), "r+b") as f:  # slot 1's record, verbatim, at slot 6
            f.seek(rs)
            rec = f.read(rs)
            f.seek(6 * rs)
            f.write(rec)
        got = await get(store, [6, 0, 2], [keys[1], keys[1], keys[2]])
        assert got == [None, None, payload(keys[2], BPB)]
        assert "slot 6: record belongs to slot 1" in caplog.text and "slot 0: key mismatch" in caplog.text


async def test_a_short_read_fails_even_when_the_row_already_holds_the_right_bytes(tmp_path):
    """A record cut by the end of the file is not verified by what the destination row happened to hold."""
    keys = [key_of(i) for i in range(3)]
    async with DiskStore(tmp_path, NS, 3) as store:
        assert (await put(store, range(3), keys)).all()
        slab = slab_of(keys, BPB)  # rows already hold exactly these blocks
        os.truncate(os.path.join(store.path, "blocks.dat"), 2 * store.record_size + HEADER_SIZE + 10)
        ok = await store.read_many(np.arange(3), key_rows(keys), slab, np.arange(3))
        assert ok.tolist() == [True, True, False]


@pytest.mark.parametrize("helpers", [0, 2])
async def test_checksums_split_over_helper_threads_verify_each_block(tmp_path, monkeypatch, helpers):
    """Large batches hash their pieces on helper threads: every piece must land on its own blocks."""
    monkeypatch.setattr(records_mod.Hasher, "split_bytes", 0)  # split even this small batch
    keys = [key_of(i) for i in range(16)]
    async with DiskStore(tmp_path, NS, 16, hash_threads=helpers) as store:
        assert (await put(store, range(16), keys)).all()
        flip(store, 13, HEADER_SIZE + 7)  # a block hashed by the last helper's piece
        got = await get(store, range(16), keys)
        assert [i for i, g in enumerate(got) if g is None] == [13]
    async with DiskStore(tmp_path, NS, 16) as store:  # headers written with split checksums verify unsplit
        assert (await get(store, range(13), keys[:13])) == [payload(k, BPB) for k in keys[:13]]
