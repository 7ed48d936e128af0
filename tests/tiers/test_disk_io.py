"""DiskIO, the CPU <-> disk handler (transfer/handlers/disk_io.py): one store batch per job, and what it counts when blocks fail.

Real objects only: a DiskStore on tmp_path, the CPU tier's slab (CpuSlabs, unpinned), CacheMetrics.
"""

from __future__ import annotations

import hashlib
import logging
import os

import numpy as np
import pytest
from disk_helpers import key_rows, payload

import tiered_kv as tkv
from tiered_kv.errors import DiskError
from tiered_kv.manager import PromoteJob, SpillJob
from tiered_kv.metrics import CacheMetrics
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.transfer.handlers import DiskIO

BPB = 8192 + 512
NS = DiskNamespace("io-model", "uint8", "io-layout", BPB, 32)
CPU_SLOTS = 80


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"io%d" % i).digest()


@pytest.fixture
def slabs():
    s = CpuSlabs(tkv.KVLayout.from_block_bytes([8192, 512], num_blocks=4), CPU_SLOTS, pin="off")
    yield s
    s.release()


class Harness:
    def __init__(self, store: DiskStore, slabs: CpuSlabs) -> None:
        self.metrics = CacheMetrics()
        self.degrade_calls = 0
        self.io = DiskIO(store, slabs, self.metrics, self._on_degrade)
        self.slab = slabs.slab_np

    def _on_degrade(self) -> None:
        self.degrade_calls += 1

    def fill(self, cpu_slots, keys) -> None:
        for c, k in zip(cpu_slots, keys, strict=True):
            self.slab[c] = np.frombuffer(payload(k, BPB), np.uint8)

    def snap(self, name: str) -> float:
        return self.metrics.snapshot().get(name, 0)


async def test_spill_and_promote_jobs_are_one_batch_each(tmp_path, slabs):
    keys = [key_of(i) for i in range(64)]
    cpu = np.random.default_rng(1).permutation(CPU_SLOTS)[:64]
    disk = np.r_[np.arange(0, 30), np.arange(50, 84)]  # 2 runs
    async with DiskStore(tmp_path, NS, 128) as store:
        h = Harness(store, slabs)
        h.fill(cpu, keys)
        ok = await h.io.write(SpillJob(key_rows(keys), cpu, disk, reuse=True))
        assert ok.all() and store.write_syscalls == 2 and store.journal_appends == 1
        h.slab[:] = 0
        back = np.arange(64)[::-1].copy()  # into other CPU slots
        ok = await h.io.read(PromoteJob(key_rows(keys), disk, back, np.arange(64)))
        assert ok.all() and store.read_syscalls == 2
        assert all(h.slab[back[i]].tobytes() == payload(keys[i], BPB) for i in range(64))
        h.io.invalidate(disk[:10])
        await store.flush()
    async with DiskStore(tmp_path, NS, 128) as store:
        assert sorted(r.slot for r in store.recovered) == disk[10:].tolist()


async def test_corrupt_records_on_promote_are_counted_and_fail_alone(tmp_path, slabs):
    keys = [key_of(i) for i in range(8)]
    async with DiskStore(tmp_path, NS, 16) as store:
        h = Harness(store, slabs)
        h.fill(range(8), keys)
        assert (await h.io.write(SpillJob(key_rows(keys), np.arange(8), np.arange(8), reuse=False))).all()
        with open(os.path.join(store.path, "blocks.dat"), "r+b") as f:
            f.seek(5 * store.record_size + 300)
            f.write(b"\xff\x00\xff")
        ok = await h.io.read(PromoteJob(key_rows(keys), np.arange(8), np.arange(8, 16), np.arange(8)))
        assert ok.tolist() == [i != 5 for i in range(8)]
        assert h.snap("tiered_kv_corrupt_blocks_total{disk}") == 1
        assert h.snap("tiered_kv_dropped_blocks_total{disk,failed_verification}") == 1
        assert h.io.writable and h.degrade_calls == 0


async def test_a_bad_job_is_dropped_without_degrading(tmp_path, slabs):
    keys = key_rows([key_of(i) for i in range(4)])
    async with DiskStore(tmp_path, NS, 16) as store:
        h = Harness(store, slabs)
        ok = await h.io.write(SpillJob(keys[:, :16], np.arange(4), np.arange(4), reuse=False))
        assert not ok.any() and h.io.writable and h.degrade_calls == 0
        assert h.snap("tiered_kv_dropped_blocks_total{disk,invalid_batch}") == 4
        # A refused read raises (a miss for the cache, not a verdict on the disk blocks' data).
        with pytest.raises(DiskError, match="promotion of 4 blocks refused"):
            await h.io.read(PromoteJob(keys, np.arange(4), np.array([0, 1, 2, CPU_SLOTS]), np.arange(4)))
        assert h.snap("tiered_kv_dropped_blocks_total{disk,invalid_batch}") == 8 and h.io.writable
        assert store.writes == store.reads == 0


async def test_enospc_degrades_once_counts_the_batch_and_reads_go_on(tmp_path, slabs, caplog):
    caplog.set_level(logging.DEBUG, "tiered_kv")
    keys = [key_of(i) for i in range(12)]
    async with DiskStore(tmp_path, NS, 32) as store:
        h = Harness(store, slabs)
        h.fill(range(12), keys)
        assert (await h.io.write(SpillJob(key_rows(keys[:4]), np.arange(4), np.arange(4), reuse=True))).all()
        fd = store._dfd
        saved, full = os.dup(fd), os.open("/dev/full", os.O_RDWR)
        os.dup2(full, fd)
        try:
            ok = await h.io.write(SpillJob(key_rows(keys[4:10]), np.arange(4, 10), np.arange(4, 10), reuse=True))
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            os.close(full)
        assert not ok.any() and not h.io.writable and "No space" in h.io.degraded and h.degrade_calls == 1
        ok = await h.io.write(SpillJob(key_rows(keys[10:]), np.arange(10, 12), np.arange(10, 12), reuse=True))
        assert not ok.any() and store.write_errors == 1  # degraded: not even tried
        assert h.snap("tiered_kv_degraded_events_total{disk}") == 1
        assert h.snap("tiered_kv_dropped_blocks_total{disk,write_failed}") == 6
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "degraded" in warnings[0] and "6 block(s)" in warnings[0]
        h.slab[:] = 0
        assert (await h.io.read(PromoteJob(key_rows(keys[:4]), np.arange(4), np.arange(4), np.arange(4)))).all()
        assert all(h.slab[i].tobytes() == payload(keys[i], BPB) for i in range(4))
