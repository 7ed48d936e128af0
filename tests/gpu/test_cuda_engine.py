"""CUDAStreamEngine on a real GPU: ordering against the compute stream, pinning, events.

The ordering tests park a long ``torch.cuda._sleep`` kernel on one stream and
check (``query()``) that it is still running when the copy is queued, so they
fail if the engine skips its stream waits instead of passing by luck. Nothing
between the sleep and the submit may synchronise the host (no list indexing,
no ``.cpu()``): index tensors are built on the GPU beforehand.

CPU regions come in the two shapes the engine accepts: column views of one
block-major pinned slab (the CPU tier's layout) and separate pinned tensors.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tiered_kv.errors import LayoutError, TransferError
from tiered_kv.layout import KVLayout
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.transfer import CUDAStreamEngine, Direction, HostCopyEngine, make_engine

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SPIN_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: far longer than any copy below
LAYOUTS = ["slab", "separate"]


def regions(num_blocks=32, num_slots=32, block_bytes=(MiB, 4096), layout="slab"):
    gpu = [torch.zeros((num_blocks, b), dtype=torch.uint8, device="cuda") for b in block_bytes]
    if layout == "separate":
        cpu = [torch.zeros((num_slots, b), dtype=torch.uint8).pin_memory() for b in block_bytes]
    else:  # as CpuSlabs lays it out: slab[:, off:off + b] per region
        slab = torch.zeros((num_slots, sum(block_bytes)), dtype=torch.uint8).pin_memory()
        cpu = list(torch.split(slab, list(block_bytes), dim=1))
    return gpu, cpu


def block_major(engine: CUDAStreamEngine) -> bool:
    """The CPU regions tile one block-major slab (one DMA per run of slots, all regions)."""
    return len(engine.host_slabs) == 1 and len(engine.host_slabs[0].regions) > 1


def gpu_index(ids):
    return torch.tensor(ids, dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gpu_ids", [list(range(8)), [17, 3, 29, 8, 11, 0, 25, 6]])
async def test_store_sees_what_the_compute_stream_wrote(gpu_ids, layout):
    gpu, cpu = regions(layout=layout)
    idx = gpu_index(gpu_ids)
    torch.cuda.synchronize()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        assert block_major(engine) == (layout == "slab")
        torch.cuda._sleep(SPIN_CYCLES)  # a long kernel on the compute stream...
        for g in gpu:
            g.index_fill_(0, idx, 7)  # ...then the write the store must copy
        handle = engine.submit_store(gpu_ids, list(range(8)))
        assert not torch.cuda.current_stream().query(), "test setup: compute stream finished too early"
        await handle
    for c in cpu:
        assert bool((c[:8] == 7).all()), "store copied before the compute stream's write (vLLM #45704)"
        assert bool((c[8:] == 0).all())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gpu_ids", [[0, 1, 2, 3], [9, 2, 30, 5]])
async def test_load_never_overwrites_blocks_the_compute_stream_still_reads(gpu_ids, layout):
    gpu, cpu = regions(layout=layout)
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


@pytest.mark.parametrize("direction", list(Direction))
async def test_submit_does_not_wait_for_the_copy_stream(direction):
    # A strided host copy would stage through pageable memory and synchronise the
    # calling (loop) thread; the block-major path must only queue work.
    gpu, cpu = regions()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        assert block_major(engine)
        # Warm-up, same batch size: the pinned index pool and both staging buffers exist afterwards.
        await engine.submit_store([5, 1, 9, 2], [0, 1, 2, 3])
        await engine.submit_load([0, 1, 2, 3], [5, 1, 9, 2])
        stream = engine.stream(direction)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(5 * SPIN_CYCLES)
        t0 = time.perf_counter()
        if direction is Direction.STORE:
            handle = engine.submit_store([17, 3, 29, 8], [4, 5, 20, 21])
        else:
            handle = engine.submit_load([4, 5, 20, 21], [17, 3, 29, 8])
        elapsed = time.perf_counter() - t0
        assert not stream.query() and not handle.done(), "submit waited for the copy stream"
        assert elapsed < 0.1, f"submit took {elapsed:.3f} s with the copy stream busy"
        await handle


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


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_staging_in_small_chunks_is_byte_exact(layout):
    widths = (8192, 300, 64)
    gen = torch.Generator().manual_seed(0)
    original = [torch.randint(0, 256, (40, b), dtype=torch.uint8, generator=gen) for b in widths]
    gpu, cpu = regions(40, 40, widths, layout)
    for g, o in zip(gpu, original, strict=True):
        g.copy_(o)
    gpu_ids = [31, 2, 17, 8, 39, 0, 22, 13, 5, 6, 7]
    slots = [3, 4, 5, 6, 7, 20, 21, 30, 11, 12, 13]
    targets = [38, 1, 19, 7, 33, 10, 25, 14, 3, 4, 5]
    async with CUDAStreamEngine(gpu, cpu, staging_bytes=2 * sum(widths)) as engine:
        await engine.submit_store(gpu_ids, slots)
        await engine.submit_load(slots, targets)
    for o, c, g in zip(original, cpu, gpu, strict=True):
        assert torch.equal(c[slots], o[gpu_ids])
        assert torch.equal(g.cpu()[targets], o[gpu_ids])


async def test_round_trip_through_the_pinned_cpu_tier():
    # The real CPU tier: one slab registered with cudaHostRegister, strided region views.
    layout = KVLayout.from_block_bytes([4096, 300, 2048], num_blocks=24)
    tier = CpuSlabs(layout, 16, pin="on")
    try:
        gen = torch.Generator().manual_seed(1)
        widths = layout.region_block_bytes
        original = [torch.randint(0, 256, (24, b), dtype=torch.uint8, generator=gen) for b in widths]
        gpu = [o.cuda() for o in original]
        async with CUDAStreamEngine(gpu, tier.regions) as engine:
            assert block_major(engine)
            await engine.submit_store([20, 3, 11, 12, 0], [8, 9, 10, 2, 3])
            for g in gpu:
                g.zero_()
            await engine.submit_load([8, 9, 10, 2, 3], [1, 5, 6, 7, 23])
        for o, c, g in zip(original, tier.regions, gpu, strict=True):
            assert torch.equal(c[[8, 9, 10, 2, 3]], o[[20, 3, 11, 12, 0]])
            assert torch.equal(g.cpu()[[1, 5, 6, 7, 23]], o[[20, 3, 11, 12, 0]])
    finally:
        tier.release()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpinned_cpu_regions_are_refused(layout):
    gpu = [torch.zeros((4, 64), dtype=torch.uint8, device="cuda") for _ in range(2)]
    slab = torch.zeros((4, 128), dtype=torch.uint8)
    if layout == "slab":
        cpu = [slab[:, :64], slab[:, 64:]]
    else:
        cpu = [torch.zeros((4, 64), dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(TransferError, match=r"cpu regions \[0, 1\] are not pinned"):
        CUDAStreamEngine(gpu, cpu)


def test_strided_cpu_regions_outside_a_slab_are_refused():
    gpu = [torch.zeros((4, 64), dtype=torch.uint8, device="cuda")]
    wide = torch.zeros((4, 128), dtype=torch.uint8).pin_memory()
    with pytest.raises(LayoutError, match="row stride of 128 bytes for 64-byte rows"):
        CUDAStreamEngine(gpu, [wide[:, :64]])


async def test_auto_picks_cuda_with_two_streams_of_its_own():
    # No priority claim: CUDA's least priority is the default one (priority_range() is (0, -N)),
    # so a copy stream can only rank beside a default compute stream, never below it.
    gpu, cpu = regions(num_blocks=4, num_slots=4, block_bytes=(64, 32))  # two small regions: not the direct road
    engine = make_engine("auto", gpu, cpu)
    assert isinstance(engine, CUDAStreamEngine)
    streams = {engine.stream(d) for d in Direction}
    assert len(streams) == 2 and torch.cuda.current_stream() not in streams
    assert {s.priority for s in streams} == {0}
    await engine.aclose()


def test_host_engine_refuses_cuda_tensors():
    gpu, cpu = regions(num_blocks=4, num_slots=4, block_bytes=(64,))
    with pytest.raises(LayoutError, match="gpu region 0 is on cuda"):
        HostCopyEngine(gpu, cpu)
