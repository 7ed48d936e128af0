"""CUDAStreamEngine on a real GPU: ordering against the compute stream, pinning, events.

The ordering tests park a long ``torch.cuda._sleep`` kernel on one stream and
check (``query()``) that it is still running when the copy is queued, so they
fail if the engine skips its stream waits instead of passing by luck. Nothing
between the sleep and the submit may synchronise the host (no list indexing,
no ``.cpu()``): index tensors are built on the GPU beforehand.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tiered_kv.errors import LayoutError, TransferError
from tiered_kv.transfer import CUDAStreamEngine, Direction, HostCopyEngine, make_engine

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SPIN_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: far longer than any copy below


def regions(num_blocks=32, num_slots=32, block_bytes=(MiB, 4096)):
    gpu = [torch.zeros((num_blocks, b), dtype=torch.uint8, device="cuda") for b in block_bytes]
    cpu = [torch.zeros((num_slots, b), dtype=torch.uint8).pin_memory() for b in block_bytes]
    return gpu, cpu


def gpu_index(ids):
    return torch.tensor(ids, dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("gpu_ids", [list(range(8)), [17, 3, 29, 8, 11, 0, 25, 6]])
async def test_store_sees_what_the_compute_stream_wrote(gpu_ids):
    gpu, cpu = regions()
    idx = gpu_index(gpu_ids)
    torch.cuda.synchronize()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        torch.cuda._sleep(SPIN_CYCLES)  # a long kernel on the compute stream...
        for g in gpu:
            g.index_fill_(0, idx, 7)  # ...then the write the store must copy
        handle = engine.submit_store(gpu_ids, list(range(8)))
        assert not torch.cuda.current_stream().query(), "test setup: compute stream finished too early"
        await handle
    for c in cpu:
        assert bool((c[:8] == 7).all()), "store copied before the compute stream's write (vLLM #45704)"
        assert bool((c[8:] == 0).all())


@pytest.mark.parametrize("gpu_ids", [[0, 1, 2, 3], [9, 2, 30, 5]])
async def test_load_never_overwrites_blocks_the_compute_stream_still_reads(gpu_ids):
    gpu, cpu = regions()
    idx = gpu_index(gpu_ids)
    for g, c in zip(gpu, cpu, strict=True):
        g.fill_(1)
        c[:4].fill_(9)
    torch.cuda.synchronize()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        torch.cuda._sleep(SPIN_CYCLES)
        seen = [torch.index_select(g, 0, idx) for g in gpu]  # compute reads after the sleep
        handle = engine.submit_load([0, 1, 2, 3], gpu_ids)
        assert not torch.cuda.current_stream().query(), "test setup: compute stream finished too early"
        await handle
    torch.cuda.synchronize()
    for s, g in zip(seen, gpu, strict=True):
        assert bool((s == 1).all()), "load overwrote blocks before the compute stream read them"
        assert bool((torch.index_select(g, 0, idx) == 9).all())


async def test_compute_stream_can_wait_on_the_load_event():
    gpu, cpu = regions()
    ids = [4, 9, 1]
    idx = gpu_index(ids)
    for c in cpu:
        c[:3].fill_(5)
    torch.cuda.synchronize()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        with torch.cuda.stream(engine.stream(Direction.LOAD)):
            torch.cuda._sleep(SPIN_CYCLES)  # keep the load stream busy
        handle = engine.submit_load([0, 1, 2], ids)
        assert handle.event is not None
        torch.cuda.current_stream().wait_event(handle.event)
        # .cpu() synchronises only the compute stream, which now waits for the load.
        seen = [torch.index_select(g, 0, idx).cpu() for g in gpu]
        await handle
    for s in seen:
        assert bool((s == 5).all()), "compute stream read the blocks before the load landed"


async def test_awaiting_a_copy_does_not_block_the_loop():
    gpu, cpu = regions()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    async with CUDAStreamEngine(gpu, cpu) as engine:
        with torch.cuda.stream(engine.stream(Direction.STORE)):
            torch.cuda._sleep(SPIN_CYCLES)
        task = asyncio.create_task(ticker())
        handle = engine.submit_store([1, 2], [3, 4])
        await handle
        task.cancel()
    assert ticks >= 10, f"the loop only ticked {ticks} times during ~0.1 s of GPU work"


async def test_cancelled_waiter_leaves_the_copy_running():
    gpu, cpu = regions()
    for g in gpu:
        g[5].fill_(3)
    torch.cuda.synchronize()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        with torch.cuda.stream(engine.stream(Direction.STORE)):
            torch.cuda._sleep(SPIN_CYCLES)
        handle = engine.submit_store([5], [0])

        async def waiter():
            await handle

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not handle.done() and engine.inflight == 1
        await handle
    for c in cpu:
        assert bool((c[0] == 3).all())


async def test_staging_in_small_chunks_is_byte_exact():
    gen = torch.Generator().manual_seed(0)
    gpu = [torch.randint(0, 256, (40, b), dtype=torch.uint8, generator=gen).cuda() for b in (8192, 300)]
    cpu = [torch.zeros((40, b), dtype=torch.uint8).pin_memory() for b in (8192, 300)]
    original = [g.cpu() for g in gpu]
    gpu_ids = [31, 2, 17, 8, 39, 0, 22, 13, 5]
    slots = [3, 4, 5, 6, 7, 20, 21, 30, 11]
    targets = [38, 1, 19, 7, 33, 10, 25, 14, 3]
    async with CUDAStreamEngine(gpu, cpu, staging_bytes=2 * 8192) as engine:
        await engine.submit_store(gpu_ids, slots)
        await engine.submit_load(slots, targets)
    for o, c, g in zip(original, cpu, gpu, strict=True):
        assert torch.equal(c[slots], o[gpu_ids])
        assert torch.equal(g.cpu()[targets], o[gpu_ids])


def test_unpinned_cpu_regions_are_refused():
    gpu = [torch.zeros((4, 64), dtype=torch.uint8, device="cuda")]
    with pytest.raises(TransferError, match=r"cpu regions \[0\] are not pinned"):
        CUDAStreamEngine(gpu, [torch.zeros((4, 64), dtype=torch.uint8)])


async def test_streams_have_the_lowest_priority_and_auto_picks_cuda():
    gpu, cpu = regions(num_blocks=4, num_slots=4, block_bytes=(64,))
    engine = make_engine("auto", gpu, cpu)
    assert isinstance(engine, CUDAStreamEngine)
    least, _ = torch.cuda.Stream.priority_range()
    assert {engine.stream(d).priority for d in Direction} == {least}
    assert engine.stream(Direction.STORE) != torch.cuda.current_stream()
    await engine.aclose()


def test_host_engine_refuses_cuda_tensors():
    gpu, cpu = regions(num_blocks=4, num_slots=4, block_bytes=(64,))
    with pytest.raises(LayoutError, match="gpu region 0 is on cuda"):
        HostCopyEngine(gpu, cpu)
