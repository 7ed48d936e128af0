"""The ShardCopier submits on the caller's thread (issue 46 item 6): no copier thread or event loop, ``poll`` reads
the engine's completion counters, ``wait`` sleeps with the GIL released and returns only once the bytes landed.
Host engine, real tensors, a real segment, TP = 1, 2, 4."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from scheduler_helpers import REGIONS, config

import tiered_kv as tkv
from tiered_kv.cross_process import LOAD, STORE, ProxyCopyEngine, ShardCopier, ShardJob, segment_info_for
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines import (
    CountedCopies,
    CountedRowEngine,
    HostCopyEngine,
    InlineCopies,
    NowCopies,
    ThreadedCopies,
    make_engine,
)
from tiered_kv.transfer.engines.base import Direction

ENGINE_THREADS = ("tiered-kv-store", "tiered-kv-load")  # the host engine's own worker per direction


def rank_kv(seed: int, num_blocks: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=g)
            for name, w in zip("kv", REGIONS, strict=True)}  # fmt: skip


def open_ranks(tmp_path, world: int) -> tuple[list[ShardCopier], list[dict[str, torch.Tensor]]]:
    kvs = [rank_kv(seed=r) for r in range(world)]
    copiers = []
    for r, kv in enumerate(kvs):
        layout = tkv.KVLayout.from_tensors(kv, 64)
        c = ShardCopier(layout, rank=r, world_size=world, engine="host")
        c.open(segment_info_for(config(tmp_path, world=world), layout, world_size=world, engine_id=f"tp{world}"))
        copiers.append(c)
    return copiers, kvs


class GatedRows:
    """The engine's native rows, each copy held until the test opens the gate."""

    def __init__(self, rows) -> None:
        self.rows, self.gate, self.entered = rows, threading.Event(), threading.Event()

    def copy(self, *args) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.rows.copy(*args)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_round_trips_its_shard_exactly_with_no_copier_thread(tmp_path, world):
    before = {t.ident for t in threading.enumerate()}
    copiers, kvs = open_ranks(tmp_path, world)
    try:
        gpu_ids, slots = np.array([5, 9, 2, 33, 34]), np.array([0, 1, 7, 3, 4])
        for c in copiers:
            c.submit([ShardJob(1, STORE, gpu_ids, slots)])
        assert [c.drain(30) for c in copiers] == [([1], [])] * world
        seg = copiers[0].segment
        for r, kv in enumerate(kvs):
            assert np.array_equal(seg.shard(r)[slots, : REGIONS[0]], kv["k"][gpu_ids].numpy())
            assert np.array_equal(seg.shard(r)[slots, REGIONS[0] :], kv["v"][gpu_ids].numpy())
        back = np.array([60, 61, 40, 41, 42])
        for c in copiers:
            c.submit([ShardJob(2, LOAD, back, slots)])
            c.wait([2], 30)
            assert c.poll() == ([2], []) and c.pending == 0
        for kv in kvs:
            for name in kv:
                assert torch.equal(kv[name][back], kv[name][gpu_ids])
        # No copier thread and no loop thread: the only threads the ranks added are their engines' workers.
        added = [t.name for t in threading.enumerate() if t.ident not in before]
        assert added and all(n.startswith(ENGINE_THREADS) for n in added), added
        assert len(added) <= 2 * world
    finally:
        for c in copiers:
            c.close()


def test_wait_returns_only_after_the_bytes_landed_and_releases_the_gil(tmp_path):
    (c,), (kv,) = open_ranks(tmp_path, 1)
    try:
        engine = c._engine
        gated = GatedRows(engine._rows)
        engine._rows = gated
        slots, ids = np.array([2, 3]), np.array([10, 11])
        c.submit([ShardJob(7, STORE, ids, slots)])
        assert gated.entered.wait(10)
        seen: dict[str, object] = {}

        def release() -> None:  # runs Python while the main thread is in wait(): the GIL is free
            time.sleep(0.1)
            seen["landed_before_release"] = np.array_equal(c.segment.shard(0)[slots, : REGIONS[0]], kv["k"][ids].numpy())
            seen["polled"] = c.poll()
            seen["pending"] = c.pending
            seen["released_at"] = time.monotonic()
            gated.gate.set()

        t = threading.Thread(target=release)
        t.start()
        c.wait([7], 10)
        returned_at = time.monotonic()
        t.join(10)
        assert seen["landed_before_release"] is False and seen["polled"] == ([], []) and seen["pending"] == 1
        assert returned_at >= seen["released_at"]
        assert np.array_equal(c.segment.shard(0)[slots, : REGIONS[0]], kv["k"][ids].numpy())
        assert c.poll() == ([7], [])
        engine._rows = gated.rows
    finally:
        gated.gate.set()
        c.close()


def test_a_wait_that_times_out_names_the_jobs_still_copying(tmp_path):
    (c,), _ = open_ranks(tmp_path, 1)
    gated = GatedRows(c._engine._rows)
    c._engine._rows = gated
    try:
        c.submit([ShardJob(3, LOAD, np.array([1]), np.array([1])), ShardJob(4, LOAD, np.array([2]), np.array([2]))])
        with pytest.raises(TransferError, match=r"jobs \[3, 4\] still copying after 0.05 s"):
            c.wait([3, 4], 0.05)
        gated.gate.set()
        assert c.drain(10) == ([3, 4], [])
    finally:
        gated.gate.set()
        c.close()


def test_the_optional_copy_modes_are_declared_protocols():
    gpu = [torch.zeros(8, 64, dtype=torch.uint8)]
    cpu = [torch.zeros(8, 64, dtype=torch.uint8)]
    counted = make_engine("host", gpu, cpu, counted=True)
    plain = make_engine("host", gpu, cpu)
    assert type(counted) is CountedRowEngine and isinstance(counted, CountedCopies)
    assert type(plain) is HostCopyEngine and not isinstance(plain, CountedCopies)
    assert isinstance(plain, InlineCopies) and isinstance(plain, ThreadedCopies) and not isinstance(plain, NowCopies)
    assert isinstance(ProxyCopyEngine(1, 8, 8), NowCopies)
    gpu[0][3] = 9
    seq = counted.start_copy(Direction.STORE, np.array([3]), np.array([5]))
    assert counted.wait_copies(Direction.STORE, seq, 10) and counted.copies_done(Direction.STORE) == (seq, {})
    assert bool((cpu[0][5] == 9).all())
    bad = counted.start_copy(Direction.STORE, np.array([3]), np.array([50]))  # slot out of range: fails, not raises
    assert counted.wait_copies(Direction.STORE, bad, 10)
    done, failed = counted.copies_done(Direction.STORE)
    assert done == bad and "cpu slot 50 out of range" in failed[bad]
    counted.close_copies()
    plain._release()
