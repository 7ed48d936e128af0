"""The direct road on a real GPU (issue 46): the driver table from libcuda, ordering, and host time per submit.

What the CPU tests cannot show: that cuGetProcAddress finds every entry, that the batch ABI chosen by the
driver's version moves the bytes, that the copy stream really waits for the caller's stream or event, and
how much host time one submit costs.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest
import torch

from tiered_kv.transfer import cuda_engine
from tiered_kv.transfer.engines.base import Direction
from tiered_kv.transfer.engines.direct import DirectCopyEngine

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SPIN_CYCLES = 200_000_000


def packed(num_blocks=96, num_slots=80, row=512 * 1024):
    gpu = [torch.randint(0, 256, (num_blocks, row), dtype=torch.uint8, device="cuda")]
    cpu = [torch.zeros((num_slots, row), dtype=torch.uint8).pin_memory()]
    return gpu, cpu


@pytest.mark.parametrize("layout", ["packed", "large-regions"])
async def test_the_real_driver_round_trips_scattered_blocks(layout):
    if layout == "packed":
        gpu, cpu = packed()
    else:
        gpu = [torch.randint(0, 256, (48, MiB), dtype=torch.uint8, device="cuda") for _ in range(3)]
        slab = torch.zeros((40, 3 * MiB), dtype=torch.uint8).pin_memory()
        cpu = list(torch.split(slab, [MiB] * 3, dim=1))
    rng = np.random.default_rng(3)
    g = rng.choice(gpu[0].shape[0], 32, replace=False)
    s = rng.choice(cpu[0].shape[0], 32, replace=False)
    async with cuda_engine(gpu, cpu, dma_rows=16, copy_path="direct") as engine:
        assert isinstance(engine, DirectCopyEngine) and engine.copy_path == "direct"
        expect = [t[torch.from_numpy(g).cuda()].cpu() for t in gpu]
        await engine.submit_store(g, s)
        for r, c in enumerate(cpu):
            assert torch.equal(c[torch.from_numpy(s)], expect[r]), f"store, region {r}"
        back = rng.choice(gpu[0].shape[0], 32, replace=False)
        await engine.submit_load(s, back)
        torch.cuda.synchronize()
        for r, t in enumerate(gpu):
            assert torch.equal(t[torch.from_numpy(back).cuda()].cpu(), expect[r]), f"load, region {r}"


@pytest.mark.parametrize("compute", ["current-stream", "stream", "event", "generic-event"])
async def test_a_store_reads_what_a_slow_writer_wrote(compute):
    gpu, cpu = packed(num_blocks=8, num_slots=8)
    async with cuda_engine(gpu, cpu, copy_path="direct") as engine:
        writer = torch.cuda.current_stream() if compute == "current-stream" else torch.cuda.Stream()
        with torch.cuda.stream(writer):
            torch.cuda._sleep(SPIN_CYCLES)
            gpu[0][2].fill_(9)
        order = None
        if compute == "stream":
            order = writer
        elif compute in ("event", "generic-event"):
            order = torch.cuda.Event() if compute == "event" else torch.Event(device="cuda")
            order.record(writer)
        handle = engine.submit_store([2], [5], compute=order)
        await asyncio.sleep(0)
        assert not writer.query(), "test setup: the writer finished too early"
        await handle
        assert bool((cpu[0][5] == 9).all()), "the store read the block before the writer was done"


async def test_host_time_per_submit_and_round_trip():
    """64 scattered blocks of one packed 512 KiB region: prints host us per submit and per round trip."""
    gpu, cpu = packed(num_blocks=256, num_slots=256)
    rng = np.random.default_rng(0)
    async with cuda_engine(gpu, cpu, copy_path="direct") as engine:
        submit_us, trip_us = [], []
        for _ in range(200):
            g, s = rng.choice(256, 64, replace=False), rng.choice(256, 64, replace=False)
            t0 = time.perf_counter()
            handle = engine.submit_store(g, s)
            t1 = time.perf_counter()
            await handle
            t2 = time.perf_counter()
            submit_us.append((t1 - t0) * 1e6)
            trip_us.append((t2 - t0) * 1e6)
        print(f"direct: submit {statistics.median(submit_us):.1f} us, round trip {statistics.median(trip_us):.1f} us "
              f"(median of 200, 64 x 512 KiB, descriptors {engine.last_descriptors(Direction.STORE)}, "
              f"batched {engine.batched})")  # fmt: skip
        assert statistics.median(submit_us) < 1000
