"""A write batch is ONE executor job: invalidations, data, commits, in that order, from one tier thread.

Faults are injected at the syscall boundary (os.pwrite for the journal's appends, os.pwritev for the data
file) on real files, and recovery is checked by reopening the directory (or a copy of it taken while the
store is open, as a crash would leave it): nothing of a failed batch is offered, and every block that is
offered reads back byte-exact.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import shutil
import threading

import numpy as np
import pytest
from disk_helpers import get, payload, put

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk.format import JCOMMIT, JINVALIDATE, JREC_SIZE

BPB = 4096 + 100
NS = DiskNamespace("job-model", "float16", "job-layout", BPB, 32)


def key_of(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"job{salt}{i}".encode()).digest()


def keys_at(slots, salt: str) -> list[bytes]:
    return [key_of(s, salt) for s in slots]


async def recovered_exact(root) -> dict[int, bytes]:
    """Reopen ``root``: slot -> key of what recovery offers, after checking each one reads back exact."""
    async with DiskStore(root, NS, 16) as store:
        rec = {r.slot: r.key for r in store.recovered}
        slots = list(rec)
        assert await get(store, slots, [rec[s] for s in slots]) == [payload(rec[s], BPB) for s in slots]
        return rec


def fail_journal_append(monkeypatch, store: DiskStore, kind: int, err: int, *, half: bool = False) -> list[int]:
    """Make the journal's appends of records of ``kind`` fail with ``err`` (after writing half of them
    when ``half``); returns a list that counts the failures."""
    real, failed = os.pwrite, []

    def pwrite(fd, data, offset):
        if fd == store._journal.fd and bytes(data[:1]) == bytes([kind]):
            if half and not failed:
                failed.append(offset)
                return real(fd, data[: len(data) // 2], offset)  # torn: the rest then fails
            failed.append(offset)
            raise OSError(err, os.strerror(err))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return failed


@pytest.mark.parametrize("fsync", [False, True])
async def test_a_batch_is_one_executor_job_in_protocol_order(tmp_path, monkeypatch, fsync):
    """An overwrite with queued invalidations: one submit to the tier's pool, and on that one thread the
    invalidations (then their fdatasync) before the data (then its fdatasync) before the commits."""
    async with DiskStore(tmp_path, NS, 16, fsync=fsync) as store:
        assert (await put(store, range(8), keys_at(range(8), "a"))).all()
        ex, submits = store._calls.executor, []
        real_submit = ex.submit

        def submit(fn, *args, **kwargs):
            submits.append(fn)
            return real_submit(fn, *args, **kwargs)

        monkeypatch.setattr(ex, "submit", submit)
        ops: list[tuple[str, str, str]] = []  # (syscall, which file, thread)
        for name in ("pwrite", "pwritev", "fdatasync"):
            real = getattr(os, name)

            def record(fd, *args, real=real, name=name):
                which = {store._journal.fd: "journal", store._dfd: "data"}.get(fd, "?")
                ops.append((name, which, threading.current_thread().name))
                return real(fd, *args)

            monkeypatch.setattr(os, name, record)
        appends = store.journal_appends
        store.invalidate_many(np.array([0]))
        assert (await put(store, [4, 5, 6, 7, 8, 12], keys_at([4, 5, 6, 7, 8, 12], "b"))).all()
        assert len(submits) == 1  # the whole batch: one hand-off
        assert store.journal_appends == appends + 2  # one append of invalidations, one of commits
        sync = [("fdatasync", "journal")] if fsync else []
        data_sync = [("fdatasync", "data")] if fsync else []
        assert [(op, f) for op, f, _ in ops] == [("pwrite", "journal"), *sync, ("pwritev", "data"),
                                                 ("pwritev", "data"), *data_sync, ("pwrite", "journal"), *sync]
        assert len({t for _, _, t in ops}) == 1 and threading.current_thread().name not in {t for _, _, t in ops}
        submits.clear()
        assert (await put(store, [13], keys_at([13], "c"))).all()  # fresh slot: no invalidations
        assert len(submits) == 1 and store.journal_appends == appends + 3
    expect = {s: key_of(s, "a") for s in (1, 2, 3)} | {s: key_of(s, "b") for s in (4, 5, 6, 7, 8, 12)}
    assert await recovered_exact(tmp_path) == expect | {13: key_of(13, "c")}


async def test_data_write_failure_journals_no_commit(tmp_path, monkeypatch):
    """The data's pwritev fails (EIO): the batch's commits never reach the journal, recovery offers none
    of it, and the slots it was overwriting are not offered with their old keys either."""
    async with DiskStore(tmp_path, NS, 16) as store:
        assert (await put(store, range(8), keys_at(range(8), "a"))).all()
        real = os.pwritev

        def pwritev(fd, bufs, offset):
            if fd == store._dfd:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, bufs, offset)

        monkeypatch.setattr(os, "pwritev", pwritev)
        appends = store.journal_appends
        with pytest.raises(DiskError) as ei:
            await put(store, range(4, 12), keys_at(range(4, 12), "b"))
        assert ei.value.errno == errno.EIO and "write of 8 blocks failed" in str(ei.value)
        assert store.journal_appends == appends + 1  # the invalidations only
        assert store.write_errors == 1
        monkeypatch.undo()
        assert await get(store, [0, 1], keys_at([0, 1], "a")) == [payload(key_of(s, "a"), BPB) for s in (0, 1)]
    assert await recovered_exact(tmp_path) == {s: key_of(s, "a") for s in range(4)}


async def test_failed_commit_append_is_cut_off_and_recovery_skips_the_batch(tmp_path, monkeypatch):
    """The commit append tears halfway and fails (ENOSPC): the torn bytes are cut off, the next batch
    appends on a record boundary, and recovery offers neither the failed batch nor the slots it overwrote."""
    root = tmp_path / "root"
    async with DiskStore(root, NS, 16) as store:
        assert (await put(store, range(4), keys_at(range(4), "a"))).all()
        jpath = os.path.join(store.path, "journal.tkv")
        before = os.path.getsize(jpath)
        failed = fail_journal_append(monkeypatch, store, JCOMMIT, errno.ENOSPC, half=True)
        with pytest.raises(DiskError) as ei:
            await put(store, range(2, 6), keys_at(range(2, 6), "b"))
        assert ei.value.errno == errno.ENOSPC and len(failed) == 2  # torn, then the rest refused
        assert os.path.getsize(jpath) == before + 2 * JREC_SIZE  # the invalidations of slots 2, 3 only
        shutil.copytree(root, tmp_path / "crashed")  # as a kill -9 right after the failure leaves it
        monkeypatch.undo()
        assert (await put(store, [6, 7], keys_at([6, 7], "c"))).all()
        assert os.path.getsize(jpath) == before + 4 * JREC_SIZE
    assert await recovered_exact(tmp_path / "crashed") == {s: key_of(s, "a") for s in (0, 1)}
    expect = {s: key_of(s, "a") for s in (0, 1)} | {s: key_of(s, "c") for s in (6, 7)}
    assert await recovered_exact(root) == expect


async def test_failed_invalidation_append_writes_no_data_and_requeues(tmp_path, monkeypatch):
    """The invalidation append fails: no data byte changes (the old blocks still read back), and the
    invalidations are queued again, so the next batch journals them even though its own slots are fresh."""
    root = tmp_path / "root"
    async with DiskStore(root, NS, 16) as store:
        assert (await put(store, range(4), keys_at(range(4), "a"))).all()
        failed = fail_journal_append(monkeypatch, store, JINVALIDATE, errno.EIO)
        with pytest.raises(DiskError) as ei:
            await put(store, [1, 2], keys_at([1, 2], "b"))
        assert ei.value.errno == errno.EIO and len(failed) == 1
        assert store.write_syscalls == 1  # only the first batch's data
        old = [payload(key_of(s, "a"), BPB) for s in range(4)]
        assert await get(store, range(4), keys_at(range(4), "a")) == old  # data untouched
        monkeypatch.undo()
        appends = store.journal_appends
        assert (await put(store, [9], keys_at([9], "c"))).all()
        assert store.journal_appends == appends + 2  # the re-queued invalidations went first
        shutil.copytree(root, tmp_path / "crashed")
    want = {s: key_of(s, "a") for s in (0, 3)} | {9: key_of(9, "c")}
    assert await recovered_exact(tmp_path / "crashed") == want
    assert await recovered_exact(root) == want


async def test_o_direct_batches_overlap_and_compaction_waits_for_them(tmp_path, monkeypatch):
    """O_DIRECT batches of other slots run their jobs beside each other, with a journal that compacts
    after most of them: every append lands on a record boundary and recovery offers exactly the last
    write per slot."""
    store = DiskStore(tmp_path, NS, 16, io_threads=4, o_direct=True)
    store.compact_slack = 4
    expect: dict[int, bytes] = {}
    real, in_flight = os.pwritev, []

    def pwritev(fd, bufs, offset):  # how many batch jobs are under way while a data write runs
        in_flight.append(store._journal._jobs)
        return real(fd, bufs, offset)

    async with store:
        if not store.o_direct_active:
            pytest.skip(f"O_DIRECT unusable here: {store.o_direct_reason}")
        monkeypatch.setattr(os, "pwritev", pwritev)
        for r in range(12):
            batches = [[(4 * i + j + r) % 16 for j in range(4)] for i in range(4)]
            res = await asyncio.gather(*(put(store, b, keys_at(b, f"r{r}")) for b in batches))
            assert all(ok.all() for ok in res)
            expect |= {s: key_of(s, f"r{r}") for b in batches for s in b}
            if r % 5 == 4:
                store.invalidate_many(np.array([r]))
        monkeypatch.undo()
        assert max(in_flight) > 1  # the jobs did overlap
        size = os.path.getsize(os.path.join(store.path, "journal.tkv"))
        assert store._journal.size == size < 80 * JREC_SIZE  # compacted: 12 rounds wrote 384 records
        store.invalidate_many(np.array([3]))  # journaled by aclose
        expect.pop(3)
    assert await recovered_exact(tmp_path) == expect


async def test_a_queued_invalidation_journaled_beside_a_batch_of_that_slot_counts_once(tmp_path, monkeypatch):
    """O_DIRECT: while batch X's data write of slot 0 hangs, slot 0 is queued for invalidation and batch Y
    (slot 5) journals it too. The mirror's live count stays the number of live slots, and recovery agrees."""
    store = DiskStore(tmp_path, NS, 16, io_threads=2, o_direct=True)
    real, entered, gate = os.pwritev, threading.Event(), threading.Event()

    def pwritev(fd, bufs, offset):
        if fd == store._dfd and not entered.is_set():
            entered.set()
            gate.wait(10)
        return real(fd, bufs, offset)

    async with store:
        if not store.o_direct_active:
            pytest.skip(f"O_DIRECT unusable here: {store.o_direct_reason}")
        assert (await put(store, [0], keys_at([0], "a"))).all()
        monkeypatch.setattr(os, "pwritev", pwritev)
        x = asyncio.create_task(put(store, [0], keys_at([0], "b")))
        while not entered.is_set():
            await asyncio.sleep(0.001)
        store.invalidate_many(np.array([0]))
        assert (await put(store, [5], keys_at([5], "c"))).all()
        gate.set()
        assert (await x).all()
        j = store._journal
        assert j.nlive == int(np.count_nonzero(j.live)) == 2
    assert await recovered_exact(tmp_path) == {0: key_of(0, "b"), 5: key_of(5, "c")}
