"""The CUDA path's contract on a real GPU (issue 21): ordering across threads and streams, chunked pinning,
store-then-load of one slot, aclose and enqueue failures with copies in flight, and a realistic batch.

As in test_cuda_engine.py, a long ``torch.cuda._sleep`` kernel is parked on a stream and ``query()``
checks it is still running when the copy is queued, so a missing wait fails instead of passing by luck.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from loop_cache import CacheThread

import tiered_kv as tkv
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.transfer import CUDAStreamEngine, Direction
from tiered_kv.transfer.engines.staged import Staging

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SPIN_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: far longer than any copy below
WIDTH = 4096


def kv_on_cuda(num_blocks: int = 32, width: int = WIDTH) -> dict[str, torch.Tensor]:
    return {n: torch.zeros((num_blocks, width), dtype=torch.uint8, device="cuda") for n in ("k", "v")}


def cache_config(num_blocks: int, bytes_per_block: int, cpu_blocks: int, **cpu) -> dict:
    return {
        "model": {"model_id": "test-model", "bytes_per_block": bytes_per_block},
        "gpu": {"num_blocks": num_blocks},
        "tiers": {"cpu": {"capacity": cpu_blocks * bytes_per_block, "pin_memory": "on", **cpu},
                  "disk": {"enabled": False}},
        "transfer": {"engine": "cuda"},
    }  # fmt: skip


def pinned_regions(num_slots: int, widths) -> list[torch.Tensor]:
    slab = torch.zeros((num_slots, sum(widths)), dtype=torch.uint8).pin_memory()
    return list(torch.split(slab, list(widths), dim=1))


# -- defect 1: the vLLM thread shape ----------------------------------------------------------------


@pytest.mark.parametrize("as_stream", [False, True], ids=["event", "stream"])
def test_store_waits_for_compute_queued_on_another_threads_stream(as_stream):
    # vLLM's model thread runs on a stream of its own; the cache's loop is another thread, whose
    # current stream is the default one. The store must wait for the model's stream anyway.
    kv = kv_on_cuda()
    layout = tkv.KVLayout.from_tensors(kv, 32)
    rt = CacheThread(cache_config(32, 2 * WIDTH, 16), layout)
    model_stream = torch.cuda.Stream()
    previous = torch.cuda.current_stream()
    try:
        keys = rt.keyer.keys_for_block_ids(range(4))
        torch.cuda.synchronize()
        torch.cuda.set_stream(model_stream)  # this thread is the model runner now
        torch.cuda._sleep(SPIN_CYCLES)
        for t in kv.values():
            t[4:8].fill_(7)  # attention writes the blocks, after the long kernel
        compute = model_stream if as_stream else torch.cuda.Event()
        if not as_stream:
            compute.record()  # on this thread's current stream: the model's
        assert not model_stream.query(), "test setup: the model stream finished too early"
        assert rt.call(rt.cache.store(keys, [4, 5, 6, 7], compute=compute)).stored == 4
        torch.cuda.set_stream(previous)
        torch.cuda.synchronize()
        for t in kv.values():
            t.zero_()
        assert rt.call(rt.cache.load(keys, [20, 21, 22, 23])) == 4
        torch.cuda.synchronize()
        for t in kv.values():
            assert bool((t[20:24] == 7).all()), "the store copied before the model's stream wrote (vLLM #45704)"
    finally:
        torch.cuda.set_stream(previous)
        rt.close()


def test_submit_from_a_thread_orders_after_that_threads_current_stream():
    # compute=None means the current stream of the thread that submits: here a loop thread whose
    # current stream was set to a busy one.
    gpu = [torch.zeros((16, 1024), dtype=torch.uint8, device="cuda")]
    cpu = [torch.zeros((16, 1024), dtype=torch.uint8).pin_memory()]
    busy = torch.cuda.Stream()
    torch.cuda.synchronize()
    result: dict[str, object] = {}

    def loop_thread() -> None:
        async def main() -> None:
            async with CUDAStreamEngine(gpu, cpu) as engine:
                torch.cuda.set_stream(busy)
                torch.cuda._sleep(SPIN_CYCLES)
                gpu[0][3].fill_(9)
                handle = engine.submit_store([3], [0])
                result["parked"] = not busy.query()
                await handle

        asyncio.run(main())

    thread = threading.Thread(target=loop_thread)
    thread.start()
    thread.join(30)
    assert result["parked"], "test setup: the busy stream finished too early"
    assert bool((cpu[0][0] == 9).all())


def test_an_unrecorded_event_is_refused():
    if torch.cuda.Event().cuda_event != 0:
        pytest.skip("this torch creates events eagerly: an unrecorded one cannot be told apart")
    gpu = [torch.zeros((4, 64), dtype=torch.uint8, device="cuda")]
    cpu = [torch.zeros((4, 64), dtype=torch.uint8).pin_memory()]

    async def main() -> None:
        async with CUDAStreamEngine(gpu, cpu) as engine:
            with pytest.raises(tkv.TransferError, match="never recorded"):
                engine.submit_store([0], [0], compute=torch.cuda.Event())

    asyncio.run(main())


# -- defect 2: chunked pinning ----------------------------------------------------------------------


@pytest.mark.parametrize("widths", [(8192, 4096, 4096), (8192, 4096, 1024)], ids=["page-rows", "odd-rows"])
async def test_chunked_pinning_and_a_run_across_a_chunk_edge(widths):
    layout = tkv.KVLayout.from_block_bytes(list(widths), num_blocks=64)
    bpb = layout.bytes_per_block
    slots = -(-4 * MiB // bpb)
    tier = CpuSlabs(layout, slots, pin="on", pin_chunk=MiB, device=torch.device("cuda", torch.cuda.current_device()))
    try:
        assert tier.pinned and tier.slab.data_ptr() % 4096 == 0
        edge = tier.dma_rows
        assert edge and (edge * bpb) % math.lcm(4096, bpb) == 0 and slots > 2 * edge
        assert all(bool(tier.slab[r].is_pinned()) for r in (0, edge - 1, edge, slots - 1))
        run = list(range(edge - 3, edge + 3))  # one run of slots, across the first chunk edge
        gen = torch.Generator().manual_seed(2)
        original = [torch.randint(0, 256, (64, w), dtype=torch.uint8, generator=gen) for w in widths]
        gpu = [o.cuda() for o in original]
        ids = [40, 3, 17, 8, 61, 0]
        async with CUDAStreamEngine(gpu, tier.regions, dma_rows=edge) as engine:
            await engine.submit_store(ids, run)
            for g in gpu:
                g.zero_()
            await engine.submit_load(run, [1, 2, 3, 4, 5, 6])
        for o, c, g in zip(original, tier.regions, gpu, strict=True):
            assert torch.equal(c[run], o[ids])
            assert torch.equal(g.cpu()[1:7], o[ids])
    finally:
        tier.release()


async def test_the_cache_starts_with_a_slab_larger_than_pin_chunk():
    # The default config pins 1 GiB capacity plus staging in 1 GiB chunks: two registrations.
    kv = kv_on_cuda(num_blocks=64, width=64 * 1024)
    layout = tkv.KVLayout.from_tensors(kv, 64)
    cfg = cache_config(64, 128 * 1024, 40, pin_chunk="1MiB")
    async with tkv.TieredKVCache(cfg, layout) as cache:
        assert cache.slabs.pinned and cache.slabs.dma_rows == 8
        keys = cache.keyer.keys_for_block_ids(range(24))
        for i in range(24):
            for t in kv.values():
                t[i].fill_(i + 1)
        assert (await cache.store(keys, list(range(24)))).stored == 24  # slots 0..23: three chunks
        for t in kv.values():
            t.zero_()
        assert await cache.load(keys, list(range(30, 54))) == 24
        torch.cuda.synchronize()
        for i in range(24):
            assert all(bool((t[30 + i] == i + 1).all()) for t in kv.values())


# -- the cross-stream hazard: a store, then a load of the same slot -------------------------------


@pytest.mark.parametrize("parked", ["compute", "store-stream"])
async def test_store_then_load_of_one_slot_across_the_two_streams(parked):
    kv = kv_on_cuda()
    layout = tkv.KVLayout.from_tensors(kv, 32)
    async with tkv.TieredKVCache(cache_config(32, 2 * WIDTH, 1), layout) as cache:  # one slot
        keys = cache.keyer.keys_for_block_ids([5])
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream() if parked == "compute" else cache.engine.stream(Direction.STORE)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN_CYCLES)
        for t in kv.values():
            t[3].fill_(7)  # on the compute stream, after the parked kernel when it is there
        store = asyncio.ensure_future(cache.store(keys, [3]))
        await asyncio.sleep(0)
        assert not stream.query(), "test setup: the parked kernel finished too early"
        assert (await store).stored == 1
        assert await cache.load(keys, [20]) == 1  # the load stream reads the slot the store stream wrote
        torch.cuda.synchronize()
        for t in kv.values():
            assert bool((t[20] == 7).all()), "the load read the slot before the store's copy landed"


# -- aclose and enqueue failures with copies in flight ---------------------------------------------


async def test_aclose_waits_for_the_copies_in_flight():
    gpu = [torch.full((8, MiB), 3, dtype=torch.uint8, device="cuda")]
    cpu = [torch.zeros((8, MiB), dtype=torch.uint8).pin_memory()]
    engine = CUDAStreamEngine(gpu, cpu)
    with torch.cuda.stream(engine.stream(Direction.STORE)):
        torch.cuda._sleep(SPIN_CYCLES)
    handles = [engine.submit_store([i], [i]) for i in range(4)]
    assert not any(h.done() for h in handles)
    await engine.aclose()
    assert all(h.done() for h in handles) and engine.inflight == 0
    assert engine.stream(Direction.STORE).query()
    assert bool((cpu[0][:4] == 3).all())


class FailingStaging(Staging):
    """A staging buffer whose ``fail_on``-th view fails, so a batch fails part-way through enqueueing."""

    def __init__(self, device: torch.device, limit_bytes: int, fail_on: int) -> None:
        super().__init__(device, limit_bytes)
        self.views, self.fail_on = 0, fail_on

    def view(self, rows: int, width: int) -> torch.Tensor:
        self.views += 1
        if self.views == self.fail_on:
            raise RuntimeError("staging failed")
        return super().view(rows, width)


async def test_an_enqueue_failure_part_way_is_reported_only_after_done():
    widths = (4096, 1024)
    gpu = [torch.full((16, w), 4, dtype=torch.uint8, device="cuda") for w in widths]
    cpu = pinned_regions(16, widths)
    async with CUDAStreamEngine(gpu, cpu, staging_bytes=2 * sum(widths)) as engine:  # two rows a chunk
        stream = engine.stream(Direction.STORE)
        engine._staging[Direction.STORE] = FailingStaging(gpu[0].device, 2 * sum(widths), fail_on=2)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN_CYCLES)
        handle = engine.submit_store([9, 2, 14, 5, 11, 0], [0, 1, 2, 3, 4, 5])  # chunk 1 queued, chunk 2 fails
        await asyncio.sleep(0.01)
        assert not stream.query() and not handle.done(), "the failure was reported while chunk 1 still ran"
        with pytest.raises(tkv.TransferError, match="failed to enqueue"):
            await handle
        assert stream.query()
        for c in cpu:
            assert bool((c[:2] == 4).all())  # chunk 1 landed before the failure was reported


# -- defect 4: no context on another GPU -----------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_cache_on_gpu_1_never_creates_a_context_on_gpu_0(tmp_path):
    script = textwrap.dedent("""
        import asyncio, torch
        import tiered_kv as tkv
        kv = {n: torch.zeros((32, 4096), dtype=torch.uint8, device="cuda:1") for n in ("k", "v")}
        layout = tkv.KVLayout.from_tensors(kv, 32)
        cfg = {"model": {"model_id": "m", "bytes_per_block": 8192}, "gpu": {"num_blocks": 32, "device": "cuda:1"},
               "tiers": {"cpu": {"capacity": "4MiB", "pin_memory": "on", "pin_chunk": "1MiB"},
                         "disk": {"enabled": False}}}
        async def main():
            async with tkv.TieredKVCache(cfg, layout) as cache:
                keys = cache.keyer.keys_for_block_ids(range(8))
                await cache.store(keys, list(range(8)))
                await cache.load(keys, list(range(8, 16)))
        asyncio.run(main())
        print("CTX0", torch._C._cuda_hasPrimaryContext(0))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CTX0 False" in out.stdout, "a thread the library owns created a context on GPU 0"


# -- a realistic batch, for the bench ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("direction", list(Direction))
async def test_a_realistic_batch_runs_near_the_pinned_dma_rate(direction):
    # 2 MiB blocks (64 regions of 32 KiB: 32 layers' K and V, region-major per layer), ~1,000 blocks a batch.
    n, layers, width = 1024, 32, 32 * 1024
    storages = [torch.randint(0, 256, (2, n, width), dtype=torch.uint8, device="cuda") for _ in range(layers)]
    gpu = [s[kv] for s in storages for kv in range(2)]
    slab = torch.empty((n, 2 * layers * width), dtype=torch.uint8).pin_memory()
    slab.fill_(1)
    cpu = list(torch.split(slab, [width] * 2 * layers, dim=1))
    ids = torch.randperm(n).tolist()
    raw_dev = torch.empty(slab.numel(), dtype=torch.uint8, device="cuda")
    # The raw reference copies to and from a pinned buffer of its own: into the slab, it would overwrite
    # what the engine's store put there before the check below reads it.
    flat = torch.empty(slab.numel(), dtype=torch.uint8).pin_memory()
    async with CUDAStreamEngine(gpu, cpu) as engine:
        assert [len(g.regions) for g in engine.gpu_groups[0]] == [2] * layers  # one kernel per layer
        ours, raw = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if direction is Direction.STORE:
                await engine.submit_store(ids, list(range(n)))
            else:
                await engine.submit_load(list(range(n)), ids)
            ours.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            (flat.copy_(raw_dev, non_blocking=True) if direction is Direction.STORE
             else raw_dev.copy_(flat, non_blocking=True))  # fmt: skip
            torch.cuda.synchronize()
            raw.append(time.perf_counter() - t0)
    ratio = statistics.median(raw[1:]) / statistics.median(ours[1:])
    print(f"{direction.value}: {slab.numel() / statistics.median(ours[1:]) / 1e9:.1f} GB/s, "
          f"{ratio:.2f} x one pinned DMA of the same bytes")  # fmt: skip
    if direction is Direction.STORE:
        for r in (0, 1, 2 * layers - 1):  # the first and the last region, in the slab the engine wrote
            assert torch.equal(slab[:, r * width : (r + 1) * width].cuda(), gpu[r][ids]), f"region {r}"
    else:
        assert torch.equal(gpu[0][ids], slab[:, :width].cuda())
    assert ratio >= 0.5, f"{direction.value} of a 2 GiB batch ran at {ratio:.2f} x the pinned DMA rate"
