"""The staged road through the real native submit (issue 46 item 3) over the fake driver: small rows are
gathered by the capped kernel (the fake runs its host reference at the launch's place in the stream) into a
ring of staging chunks, and each chunk goes to the slab as one batch of run descriptors; loads the reverse.
Counts per call: one ids copy, one launch and one batch per chunk, at most 16 programs a launch."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import ConfigError, LayoutError
from tiered_kv.transfer.engines.base import Direction
from tiered_kv.transfer.engines.direct import DirectCopyEngine

fake = core.fake_cuda
NUM_BLOCKS, NUM_SLOTS = 40, 32


@pytest.fixture(autouse=True)
def no_leaks():
    before = fake.live()
    yield
    assert fake.live() == before, "an engine left fake events or streams behind"


def layout(widths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gpu = [torch.randint(0, 256, (NUM_BLOCKS, w + 3), dtype=torch.uint8, generator=gen)[:, :w] for w in widths]
    slab = torch.zeros(NUM_SLOTS, sum(widths), dtype=torch.uint8)
    return gpu, list(torch.split(slab, list(widths), dim=1))


@pytest.mark.parametrize("widths", [(40, 24, 8), (3, 17, 1000), (512,) * 20])
@pytest.mark.parametrize("dma_rows", [None, 4])
async def test_staged_round_trips_are_bit_exact_with_a_launch_and_a_batch_per_chunk(widths, dma_rows):
    gpu, cpu = layout(widths)
    before = [g.clone() for g in gpu]
    rng = np.random.default_rng(sum(widths))
    ids, slots = rng.permutation(NUM_BLOCKS)[:22], np.concatenate([np.arange(3, 13), rng.permutation(np.arange(13, 32))[:12]])
    chunk = 3 * sum(widths)  # 3 rows a chunk: 8 chunks through a ring of 4
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", road="staged", chunk_bytes=chunk, dma_rows=dma_rows) as engine:
        assert engine.copy_path == f"staged(min_row=1048576,ring=4x{chunk}B,programs=16)"
        fake.reset_counts()
        await engine.submit_store(ids, slots)
        counts = fake.counts()
        assert (counts["memcpy"], counts["launch"], counts["batch"]) == (1, 8, 8)
        regions = len(widths)  # 7 chunks of 3 rows and one of 1; at most 16 programs a launch
        assert counts["programs"] == 7 * min(16, 3 * regions) + min(16, regions)
        for b, c in zip(before, cpu, strict=True):
            assert torch.equal(c[torch.as_tensor(slots)], b[torch.as_tensor(ids)])
        for g in gpu:
            g.zero_()
        back = rng.permutation(NUM_BLOCKS)[:22]
        await engine.submit_load(slots, back)
        for g, b in zip(gpu, before, strict=True):
            assert torch.equal(g[torch.as_tensor(back)], b[torch.as_tensor(ids)])
            rest = torch.ones(NUM_BLOCKS, dtype=torch.bool)
            rest[torch.as_tensor(back)] = False
            assert not g[rest].any(), "the scatter wrote outside its blocks"


async def test_calls_in_flight_each_use_their_own_ids_slot():
    gpu, cpu = layout((40, 24, 8), seed=2)
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", road="staged", chunk_bytes=2 * 72, max_inflight=2) as engine:
        stream = engine.stream_handle(Direction.STORE)
        fake.hold(stream)
        try:
            plans = [(np.arange(4 * k, 4 * k + 4)[::-1].copy(), np.arange(4 * k, 4 * k + 4)) for k in range(6)]
            handles = [engine.submit_store(g, s) for g, s in plans]  # 2 issued, 4 parked (ids written at issue)
            assert engine.queued(Direction.STORE) == (2, 4)
        finally:
            fake.hold(stream, False)
        await asyncio.wait_for(asyncio.gather(*handles), 5)
        for g, s in plans:
            for gr, c in zip(gpu, cpu, strict=True):
                assert torch.equal(c[torch.as_tensor(s)], gr[torch.as_tensor(g)])


async def test_auto_takes_the_staged_road_for_small_rows_only():
    gpu, cpu = layout((40, 24))
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", road="auto") as engine:
        assert engine.copy_path.startswith("staged(") and engine.copy_path.endswith("ring=4x8MiB,programs=16)")
    one = [torch.zeros(8, 64, dtype=torch.uint8)]
    async with DirectCopyEngine(one, [torch.zeros(8, 64, dtype=torch.uint8)], driver="fake:13000", road="auto") as engine:
        assert engine.copy_path == "direct"  # one region per block id: contiguous on the GPU, no kernel


def test_bad_roads_are_refused_and_leave_nothing_behind():
    gpu, cpu = layout((40, 24))
    with pytest.raises(ConfigError, match="road must be direct, staged or auto, got 'fast'"):
        DirectCopyEngine(gpu, cpu, driver="fake:13000", road="fast")
    separate = [torch.zeros(NUM_SLOTS, 40, dtype=torch.uint8), torch.zeros(NUM_SLOTS, 24, dtype=torch.uint8)]
    with pytest.raises(LayoutError, match="one block-major slab"):
        DirectCopyEngine(gpu, separate, driver="fake:13000", road="staged")
