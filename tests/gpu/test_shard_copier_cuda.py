"""The worker's ShardCopier with the CUDA engine at TP = 1, 2, 4 (issue 27), on whatever GPUs there are:
rank r runs on GPU r % device_count, so one GPU hosts every rank when two are not there. Each rank maps
the rank-major segment, pins only its own sub-slab, and its copies are ordered after the work queued on
the caller's current stream at ``submit`` (the store is submitted after the forward, in wait_for_save).
Also the CUDA side of defects A and E: a CpuSlabs pinned slab reports pinned; a generic torch.Event orders.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import tiered_kv as tkv
from tiered_kv.cross_process import LOAD, STORE, ShardCopier, ShardJob, segment_info_for
from tiered_kv.layout import KVLayout
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.transfer import CUDAStreamEngine

pytestmark = pytest.mark.gpu

REGIONS = (768 * 1024, 256 * 1024)  # 1 MiB per rank per block
SPIN_CYCLES = 200_000_000  # ~0.1 s: far longer than the copies below


def config(shm_path, world: int, cpu_blocks: int = 16) -> dict:
    shard = sum(REGIONS)
    return {"model": {"model_id": "gpu-split", "bytes_per_block": world * shard}, "gpu": {"num_blocks": 32},
            "tiers": {"cpu": {"capacity": cpu_blocks * world * shard, "shared_path": str(shm_path)},
                      "disk": {"enabled": False}}}  # fmt: skip


def device_of(rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count())


def rank_kv(rank: int, num_blocks: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {name: torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=g).to(device_of(rank))
            for name, w in zip("kv", REGIONS, strict=True)}  # fmt: skip


def copiers(shm_path, world: int, pin_chunk: int = 1 << 30):
    kvs = [rank_kv(r) for r in range(world)]
    out = []
    for r, kv in enumerate(kvs):
        layout = tkv.KVLayout.from_tensors(kv, 32)
        c = ShardCopier(layout, rank=r, world_size=world, engine="auto", pin_chunk=pin_chunk)
        c.open(segment_info_for(config(shm_path, world), layout, world_size=world, engine_id="gpu"))
        out.append(c)
    return kvs, out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_auto_picks_cuda_at_every_tp_size_and_each_rank_copies_its_sub_slab(shm_path, world):
    kvs, cs = copiers(shm_path, world, pin_chunk=4 << 20)  # small chunks: runs cross registration edges
    try:
        for c in cs:
            assert c.kind == "cuda"  # refused nowhere
            sub = c.segment.shard(c.rank)
            assert torch.from_numpy(sub).is_pinned()  # its own sub-slab, and only that, is registered
            others = [r for r in range(world) if r != c.rank]
            assert not any(torch.from_numpy(c.segment.shard(r)).is_pinned() for r in others)
        gpu_ids, slots = np.array([5, 9, 2, 20, 21, 22, 3]), np.array([0, 1, 7, 8, 9, 10, 15])
        for c in cs:
            c.submit([ShardJob(1, STORE, gpu_ids, slots)])
        assert [c.drain(60) for c in cs] == [([1], [])] * world
        seg = cs[0].segment
        for r, kv in enumerate(kvs):
            sub = seg.shard(r)
            assert np.array_equal(sub[slots, : REGIONS[0]], kv["k"][gpu_ids].cpu().numpy())
            assert np.array_equal(sub[slots, REGIONS[0] :], kv["v"][gpu_ids].cpu().numpy())
        back = np.array([30, 31, 12, 13, 14, 15, 16])
        for c in cs:
            c.submit([ShardJob(2, LOAD, back, slots)])
            c.wait([2], 60)  # a synchronous load: attention may read the blocks now
        for kv in kvs:
            for t in kv.values():
                assert torch.equal(t[back], t[gpu_ids])
        assert [c.poll() for c in cs] == [([2], [])] * world
    finally:
        for c in cs:
            c.close()


def test_a_store_is_ordered_after_what_the_callers_current_stream_queued(shm_path):
    kvs, cs = copiers(shm_path, 2)
    try:
        c, kv = cs[1], kvs[1]
        forward = torch.cuda.Stream(device=kv["k"].device)
        with torch.cuda.device(kv["k"].device), torch.cuda.stream(forward):
            torch.cuda._sleep(SPIN_CYCLES)  # the forward pass, still running ...
            kv["k"][4].fill_(0xAB)  # ... whose last kernel writes the block we store
            c.submit([ShardJob(7, STORE, np.array([4]), np.array([3]))])  # wait_for_save: same thread, same stream
        assert not forward.query(), "the forward finished before the store was queued: the test proves nothing"
        assert c.drain(60) == ([7], [])
        assert (c.segment.shard(1)[3, : REGIONS[0]] == 0xAB).all()
    finally:
        for c in cs:
            c.close()


def test_the_cpu_tiers_pinned_slab_reports_pinned_and_the_engine_starts():
    """Defect A: the slab was a view past the start of its storage, so is_pinned() said False and
    CUDAStreamEngine refused the CPU tier ("cpu regions are not pinned")."""
    layout = KVLayout.from_block_bytes([4096, 300, 2048], num_blocks=24)
    for slots in (1, 7, 1000):
        tier = CpuSlabs(layout, slots, pin="on", device=torch.device("cuda", 0))
        try:
            assert tier.pinned and tier.slab.is_pinned() and all(r.is_pinned() for r in tier.regions)
            gpu = [torch.zeros((24, w), dtype=torch.uint8, device="cuda") for w in layout.region_block_bytes]
            asyncio.run(CUDAStreamEngine(gpu, tier.regions).aclose())
        finally:
            tier.release()


async def test_a_generic_torch_event_orders_the_copy():
    """Defect E: vLLM records a torch.Event, not a torch.cuda.Event."""
    gpu = [torch.zeros((8, 4096), dtype=torch.uint8, device="cuda")]
    cpu = [torch.zeros((8, 4096), dtype=torch.uint8).pin_memory()]
    async with CUDAStreamEngine(gpu, cpu) as engine:
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(SPIN_CYCLES)
            gpu[0][2].fill_(9)
            event = torch.Event(device="cuda")
            event.record(compute)
        handle = engine.submit_store([2], [5], compute=event)
        assert not compute.query()
        await handle
        assert bool((cpu[0][5] == 9).all())


def test_a_cuda_rank_keeps_whole_step_synchronous_loads(shm_path):
    """Layer-wise loads (cross_process/layer_loads.py) are host-only for now: a CUDA rank refuses them, so
    the worker waits for its synchronous loads in start_load_kv as before (issue 39 item 4)."""
    from tiered_kv.cross_process import layer_groups

    kvs, cs = copiers(shm_path, 1)
    try:
        assert not cs[0].enable_layers(layer_groups(kvs[0], cs[0].layout.regions))
    finally:
        for c in cs:
            c.close()
