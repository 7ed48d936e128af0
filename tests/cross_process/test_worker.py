"""ShardCopier in one process: its per-rank bytes check, its numpy copies, its fences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scheduler_helpers import REGIONS, WORLD, config

import tiered_kv as tkv
from tiered_kv.cross_process import LOAD, STORE, ShardCopier, ShardJob, segment_info_for
from tiered_kv.errors import LayoutError, TransferError


def rank_kv(num_blocks: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randint(0, 256, (num_blocks, REGIONS[0]), dtype=torch.uint8, generator=g),
            "v": torch.randint(0, 256, (num_blocks, REGIONS[1]), dtype=torch.uint8, generator=g)}  # fmt: skip


def copier_for(tmp_path, rank, kv, **layout_kw):
    layout = tkv.KVLayout.from_tensors(kv, 64, **layout_kw)
    copier = ShardCopier(layout, rank=rank, world_size=WORLD)
    copier.open(segment_info_for(config(tmp_path), layout, world_size=WORLD, engine_id="w"))
    return copier


def test_each_rank_copies_its_shard_and_back(tmp_path):
    kvs = [rank_kv(seed=r) for r in range(WORLD)]
    copiers = [copier_for(tmp_path, r, kvs[r]) for r in range(WORLD)]
    try:
        store = ShardJob(1, STORE, np.array([5, 9, 2]), np.array([0, 1, 7]))
        for c in copiers:
            c.submit([store])
        assert [c.drain(30) for c in copiers] == [([1], [])] * WORLD
        seg = copiers[0].segment
        for r, kv in enumerate(kvs):
            shard = seg.shard(r)  # rank r's own contiguous sub-slab
            assert np.array_equal(shard[[0, 1, 7], :768], kv["k"][[5, 9, 2]].numpy())
            assert np.array_equal(shard[[0, 1, 7], 768:], kv["v"][[5, 9, 2]].numpy())
        load = ShardJob(2, LOAD, np.array([40, 41, 60]), np.array([0, 1, 7]))
        for c in copiers:
            c.submit([load])
            c.wait([2], 30)
            assert c.poll() == ([2], [])
        for kv in kvs:
            for name in kv:
                assert torch.equal(kv[name][[40, 41, 60]], kv[name][[5, 9, 2]])
    finally:
        for c in copiers:
            c.close()


def test_a_bad_job_is_reported_failed_not_raised(tmp_path):
    c = copier_for(tmp_path, 0, rank_kv())
    try:
        c.submit([ShardJob(7, STORE, np.array([1]), np.array([10_000])), ShardJob(8, STORE, np.array([1]), np.array([2]))])
        assert c.drain(30) == ([8], [7])
        assert c.pending == 0
    finally:
        c.close()
    with pytest.raises(TransferError, match="after close"):
        c.submit([ShardJob(9, STORE, np.array([1]), np.array([2]))])


def test_a_rank_whose_bytes_per_block_differs_refuses_naming_both(tmp_path):
    c0 = copier_for(tmp_path, 0, rank_kv())
    odd = {"k": torch.zeros(64, 768, dtype=torch.uint8), "v": torch.zeros(64, 512, dtype=torch.uint8)}
    with pytest.raises(LayoutError, match="give 1280 bytes per block per TP rank but the segment was made for 1024"):
        copier_for(tmp_path, 1, odd)
    c0.close()


def test_padding_of_a_whole_region_does_not_change_the_rank_bytes(tmp_path):
    """vLLM #54021: 4 KiB of allocator padding past the logical bytes is not an extra region."""
    storage = torch.zeros(64 * 1024 + 4096, dtype=torch.uint8)
    kv = {"kv": storage[: 64 * 1024].view(64, 1024)}
    layout = tkv.KVLayout.from_tensors(kv, 64, logical_sizes=[64 * 1024])
    assert layout.bytes_per_block == 1024 and storage.untyped_storage().nbytes() == 64 * 1024 + 4096
    c = ShardCopier(layout, rank=0, world_size=WORLD)
    c.open(segment_info_for(config(tmp_path), layout, world_size=WORLD, engine_id="w"))
    c.close()
