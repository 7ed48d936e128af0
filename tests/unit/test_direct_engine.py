"""The direct road's engine (transfer/engines/direct.py, issue 46) over the native fake CUDA driver.

CPU tensors stand in for GPU memory; the fake's streams run on the host, count every driver call, and
run nothing while a test holds them. The generic engine contract (byte-exact patterns, bad ids, aclose,
cancellation) runs over this engine too, as "direct-fake" in test_transfer.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import ConfigError, LayoutError, TransferError
from tiered_kv.transfer import cuda_engine
from tiered_kv.transfer.engines.base import CountedCopies, Direction
from tiered_kv.transfer.engines.counted import CountedDirectEngine
from tiered_kv.transfer.engines.direct import DIRECT_MIN_ROW, DirectCopyEngine, RawHandle, direct_eligible

fake = core.fake_cuda
NUM_BLOCKS, NUM_SLOTS = 40, 32


@pytest.fixture(autouse=True)
def no_leaks():
    before = fake.live()
    yield
    assert fake.live() == before, "an engine left fake events or streams behind"


def regions(geometry: str, seed: int = 0):
    """(gpu, cpu) CPU tensors: a packed region; several large regions in a block-major slab; separate slabs;
    GPU rows with a stride above the row (a view into wider rows: not dense, one descriptor per row)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)  # noqa: E731
    if geometry == "packed":
        return [rand(NUM_BLOCKS, 8192)], [torch.zeros(NUM_SLOTS, 8192, dtype=torch.uint8)]
    widths = (4096, 2048, 1024)
    gpu = [rand(NUM_BLOCKS, w) for w in widths]
    if geometry == "block-major":
        slab = torch.zeros(NUM_SLOTS, sum(widths), dtype=torch.uint8)
        return gpu, list(torch.split(slab, list(widths), dim=1))
    if geometry == "separate":
        return gpu, [torch.zeros(NUM_SLOTS, w, dtype=torch.uint8) for w in widths]
    wide = rand(NUM_BLOCKS, 6000)
    return [wide[:, :4096], wide[:, 4096:5120]], [torch.zeros(NUM_SLOTS, w, dtype=torch.uint8) for w in (4096, 1024)]


def ids(pattern: str, n: int, universe: int, rng: np.random.Generator) -> np.ndarray:
    if pattern == "contiguous":
        start = int(rng.integers(0, universe - n + 1))
        return np.arange(start, start + n)
    if pattern == "reversed":
        return np.arange(n - 1, -1, -1)
    return rng.permutation(universe)[:n]


def runs(gpu_ids, slots, dma_rows=0) -> int:
    order = np.argsort(slots, kind="stable")
    g, s = np.asarray(gpu_ids)[order], np.asarray(slots)[order]
    joins = (np.diff(s) == 1) & (np.diff(g) == 1)
    if dma_rows:
        joins &= s[1:] % dma_rows != 0
    return len(s) - int(joins.sum()) if len(s) else 0


@pytest.mark.parametrize("geometry", ["packed", "block-major", "separate", "strided-gpu"])
@pytest.mark.parametrize("pattern", ["scattered", "contiguous", "reversed"])
@pytest.mark.parametrize("dma_rows", [None, 4])
async def test_round_trips_are_bit_exact_with_one_batch_per_call(geometry, pattern, dma_rows):
    gpu, cpu = regions(geometry)
    before = [g.clone() for g in gpu]
    rng = np.random.default_rng(hash((geometry, pattern)) % 2**32)
    gpu_ids, slots = ids(pattern, 24, NUM_BLOCKS, rng), ids(pattern, 24, NUM_SLOTS, rng)
    async with DirectCopyEngine(gpu, cpu, dma_rows=dma_rows, driver="fake:13000") as engine:
        assert engine.copy_path == "direct" and engine.batched
        fake.reset_counts()
        await engine.submit_store(gpu_ids, slots)
        for g, c in zip(before, cpu, strict=True):
            assert torch.equal(c[torch.as_tensor(slots)], g[torch.as_tensor(gpu_ids)])
        dense = sum(1 for g, c in zip(gpu, cpu, strict=True) if g.stride(0) == g.shape[1] == c.stride(0))
        expected = dense * runs(gpu_ids, slots, dma_rows or 0) + (len(gpu) - dense) * len(slots)
        assert engine.last_descriptors(Direction.STORE) == expected
        counts = fake.counts()
        assert (counts["batch"], counts["descriptors"], counts.get("memcpy", 0)) == (1, expected, 0)
        for g in gpu:
            g.zero_()
        back = np.roll(gpu_ids, 5)  # into other blocks than they came from
        await engine.submit_load(slots, back)
        for g, b in zip(gpu, before, strict=True):
            assert torch.equal(g[torch.as_tensor(back)], b[torch.as_tensor(gpu_ids)])
        assert fake.counts()["batch"] == 2


async def test_each_call_waits_on_the_ready_event_then_records_done():
    gpu, cpu = regions("packed")
    compute, ready = fake.stream_create(), fake.event_create()
    try:
        async with DirectCopyEngine(gpu, cpu, driver="fake:13000") as engine:
            fake.hold(compute)  # the model's stream has not reached its event yet
            fake.record(ready, compute)
            fake.reset_counts()
            handle = engine.submit_store([3, 4, 5], [0, 1, 2], compute=RawHandle(ready))
            counts = fake.counts()
            assert (counts["wait"], counts["record"], counts["batch"], counts["descriptors"]) == (1, 1, 1, 1)
            await asyncio.sleep(0.02)
            assert not handle.done() and not cpu[0][:3].any(), "the copy ran before the ready event"
            fake.hold(compute, False)
            await handle
            assert torch.equal(cpu[0][:3], gpu[0][3:6])
            # A stream: the engine records its own ready event on it (2 records, 1 wait).
            fake.hold(compute)
            fake.reset_counts()
            handle = engine.submit_load([0], [9], compute=RawHandle(compute, stream=True))
            assert (fake.counts()["record"], fake.counts()["wait"]) == (2, 1)
            await asyncio.sleep(0.02)
            assert not handle.done()
            fake.hold(compute, False)
            await handle
            assert torch.equal(gpu[0][9], cpu[0][0])
    finally:
        fake.event_destroy(ready)
        fake.stream_destroy(compute)


async def test_completions_resolve_in_fifo_order_one_wakeup_per_burst():
    gpu, cpu = regions("packed")
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000") as engine:
        stream = engine.stream_handle(Direction.STORE)
        fake.hold(stream)
        handles = [engine.submit_store([i], [i]) for i in range(6)]
        await asyncio.sleep(0.02)
        assert not any(h.done() for h in handles) and engine.inflight == 6
        for k in range(2):  # one at a time: the oldest first
            fake.step(stream, 1)
            await asyncio.wait_for(handles[k], 2)
            assert [h.done() for h in handles] == [i <= k for i in range(6)]
        wakeups = engine.wakeups
        fake.step(stream, 4)  # a burst: the loop sleeps (blocked on purpose) while all four complete
        time.sleep(0.1)
        await asyncio.sleep(0.01)
        assert all(h.done() for h in handles)
        assert engine.wakeups == wakeups + 1, "a burst of completions took more than one loop wakeup"
        fake.hold(stream, False)
        assert all(torch.equal(cpu[0][i], gpu[0][i]) for i in range(6))


async def test_cancelling_the_awaiting_task_leaves_the_copy_in_flight():
    gpu, cpu = regions("packed")
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000") as engine:
        stream = engine.stream_handle(Direction.LOAD)
        fake.hold(stream)
        cpu[0][2] = 7
        handle = engine.submit_load([2], [11])
        task = asyncio.create_task(asyncio.wait_for(handle, 10))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not handle.future.cancelled() and not handle.done() and engine.inflight == 1
        fake.hold(stream, False)
        await handle
        assert handle.future.exception() is None and bool((gpu[0][11] == 7).all())


async def test_aclose_drains_in_flight_calls_and_frees_every_handle():
    gpu, cpu = regions("block-major")
    live = fake.live()
    engine = DirectCopyEngine(gpu, cpu, driver="fake:13000")
    assert fake.live() == (live[0] + 2, live[1] + 2)  # a ready event and a stream per direction
    stream = engine.stream_handle(Direction.STORE)
    fake.hold(stream)
    handles = [engine.submit_store([i], [i]) for i in range(3)]
    closing = asyncio.ensure_future(engine.aclose())
    await asyncio.sleep(0.02)
    assert not closing.done() and engine.closed
    with pytest.raises(TransferError, match="closed"):
        engine.submit_store([5], [5])
    fake.hold(stream, False)
    await asyncio.wait_for(closing, 5)
    assert all(h.done() for h in handles) and engine.inflight == 0
    assert fake.live() == live


async def test_a_failed_batch_fails_its_future_after_the_copy_stream_passed_it():
    gpu, cpu = regions("packed")
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000") as engine:
        fake.fail_batches(1)
        handle = engine.submit_store([1], [1])
        with pytest.raises(TransferError, match=r"direct store \(call 1\) failed: cuMemcpyBatchAsync of 1 copies "
                                                r"failed with CUresult 1"):  # fmt: skip
            await handle
        await engine.submit_store([2], [2])  # the engine goes on
        assert torch.equal(cpu[0][2], gpu[0][2])


@pytest.mark.parametrize(("version", "batched"), [(12000, False), (12080, True)])
async def test_older_drivers(version, batched):
    gpu, cpu = regions("packed")
    async with DirectCopyEngine(gpu, cpu, driver=f"fake:{version}") as engine:
        fake.reset_counts()
        await engine.submit_store([1, 2, 3, 9], [4, 5, 6, 0])
        counts = fake.counts()
        assert engine.batched is batched
        assert (counts.get("batch", 0), counts.get("memcpy", 0)) == ((1, 0) if batched else (0, 2))
        assert torch.equal(cpu[0][4:7], gpu[0][1:4]) and torch.equal(cpu[0][0], gpu[0][9])


def test_which_layouts_take_the_direct_road():
    one = [torch.zeros(4, 64, dtype=torch.uint8)]
    assert direct_eligible(one, [torch.zeros(4, 64, dtype=torch.uint8)])  # one region per block id
    small = [torch.zeros(2, 32 << 10, dtype=torch.uint8) for _ in range(2)]
    assert not direct_eligible(small, [torch.zeros(2, 32 << 10, dtype=torch.uint8) for _ in range(2)])
    big = [torch.zeros(2, DIRECT_MIN_ROW, dtype=torch.uint8) for _ in range(2)]
    assert direct_eligible(big, [torch.zeros(2, DIRECT_MIN_ROW, dtype=torch.uint8) for _ in range(2)])
    strided_cpu = torch.zeros(4, 128, dtype=torch.uint8)[:, :64]  # a slab it cannot address as rows
    assert not direct_eligible(one, [strided_cpu])
    with pytest.raises(ConfigError, match="copy path 'direct' needs"):
        cuda_engine(one, [strided_cpu], copy_path="direct")
    with pytest.raises(LayoutError, match="gpu region 0 is on cpu"):  # the real driver needs CUDA tensors
        cuda_engine(one, [torch.zeros(4, 64, dtype=torch.uint8)], copy_path="direct")


def test_counted_copies_need_no_loop_and_wait_with_the_gil_released():
    """The worker's loop-free mode (CountedDirectEngine, base.CountedCopies): counters, a blocking wait."""
    gpu, cpu = regions("packed")
    engine = CountedDirectEngine(gpu, cpu, driver="fake:13000")
    assert isinstance(engine, CountedCopies)
    stream = engine.stream_handle(Direction.STORE)
    try:
        fake.hold(stream)
        seq = engine.start_copy(Direction.STORE, np.array([3, 4]), np.array([0, 1]))
        assert engine.copies_done(Direction.STORE) == (0, {}) and not engine.wait_copies(Direction.STORE, seq, 0.05)
        assert not cpu[0][:2].any()
        released = []
        releaser = threading.Timer(0.1, lambda: (released.append(time.monotonic()), fake.hold(stream, False)))
        releaser.start()  # runs Python while this thread waits: the wait does not hold the GIL
        assert engine.wait_copies(Direction.STORE, seq, 10)
        assert released and torch.equal(cpu[0][:2], gpu[0][3:5])
        assert engine.copies_done(Direction.STORE) == (seq, {})
        fake.fail_batches(1)
        bad = engine.start_copy(Direction.LOAD, np.array([0]), np.array([9]))
        assert engine.wait_copies(Direction.LOAD, bad, 10)
        done, failed = engine.copies_done(Direction.LOAD)
        assert done == bad and "cuMemcpyBatchAsync of 1 copies failed" in failed[bad]
    finally:
        fake.hold(stream, False)  # a failed check must not leave the copier's thread waiting on a held stream
        engine.close_copies()
    assert engine.closed
