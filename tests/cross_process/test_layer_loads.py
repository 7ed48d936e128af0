"""Layer-wise synchronous loads on a host rank (issue 39 item 4), with real tensors and a real segment."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from scheduler_helpers import WORLD, config

import tiered_kv as tkv
from tiered_kv.cross_process import LOAD, LayerLoads, ShardCopier, ShardJob, layer_groups, segment_info_for
from tiered_kv.errors import TransferError

LAYERS = ["l0", "l1", "l2", "l3"]  # four layers of 256 bytes per block: one rank's 1 KiB shard


def layer_kv(num_blocks: int = 64) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(num_blocks, 256, dtype=torch.uint8) for name in LAYERS}


def slab_regions(slots: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    slab = torch.randint(1, 256, (slots, 1024), dtype=torch.uint8, generator=g)
    return [slab[:, 256 * i : 256 * (i + 1)] for i in range(4)]


def test_layer_groups_name_each_tensors_regions_by_address():
    kv = layer_kv()
    kv["kv_pair"] = torch.zeros(2, 64, 128, dtype=torch.uint8)  # K then V along dim 0: two regions
    layout = tkv.KVLayout.from_tensors(kv, 64, block_dim={"kv_pair": 1, **dict.fromkeys(LAYERS, 0)})
    groups = layer_groups(kv, layout.regions)
    assert groups == {"l0": [0], "l1": [1], "l2": [2], "l3": [3], "kv_pair": [4, 5]}


def test_wait_for_a_layer_returns_once_its_rows_landed_before_the_later_layers():
    kv = layer_kv()
    layout = tkv.KVLayout.from_tensors(kv, 64)
    cpu = slab_regions()
    gate = threading.Event()
    started: list[int] = []

    def pace(group: int) -> None:  # layer 2 and later wait for the test to let them go
        started.append(group)
        if group == 2:
            assert gate.wait(10)

    layers = LayerLoads(layout.regions, cpu, layer_groups(kv, layout.regions), pace=pace)
    finished: list[tuple[int, bool]] = []
    slots, ids = np.array([3, 4, 5, 6]), np.array([40, 41, 42, 43])
    try:
        load = layers.start([ShardJob(7, LOAD, ids, slots)], lambda j, ok: finished.append((j, ok)))
        load.wait_edges(10)
        for name in LAYERS:  # the last block (the one a forward may write) landed whole first
            assert torch.equal(kv[name][43], cpu[LAYERS.index(name)][6])
        load.wait_layer("l1", 10)
        for i in (0, 1):
            assert torch.equal(kv[LAYERS[i]][ids], cpu[i][slots])
        assert not load.events[2].is_set()  # layer 2 is held back: its earlier blocks are still zeros
        assert int(kv["l2"][ids[:-1]].sum()) == 0 and int(kv["l3"][ids[:-1]].sum()) == 0
        assert finished == []
        gate.set()
        load.wait_layer("l3", 10)
        load.finished.wait(10)
        assert started == [0, 1, 2, 3]  # layer order
        for i, name in enumerate(LAYERS):
            assert torch.equal(kv[name][ids], cpu[i][slots])
        assert finished == [(7, True)]
    finally:
        gate.set()
        layers.close()


def test_a_failed_layered_copy_wakes_every_waiter_and_fails_its_jobs():
    kv = layer_kv()
    layout = tkv.KVLayout.from_tensors(kv, 64)
    layers = LayerLoads(layout.regions, slab_regions(), layer_groups(kv, layout.regions))
    finished: list[tuple[int, bool]] = []
    try:
        load = layers.start(
            [ShardJob(9, LOAD, np.array([1, 2]), np.array([0, 99]))], lambda j, ok: finished.append((j, ok))
        )
        load.wait_layer("l3", 10)
        load.finished.wait(10)
        assert load.error is not None and finished == [(9, False)]
    finally:
        layers.close()


def test_the_copier_issues_synchronous_loads_layer_by_layer_and_reports_them(tmp_path):
    kv = layer_kv()
    layout = tkv.KVLayout.from_tensors(kv, 64)
    copier = ShardCopier(layout, rank=0, world_size=WORLD)
    copier.open(segment_info_for(config(tmp_path), layout, world_size=WORLD, engine_id="layers"))
    try:
        assert copier.enable_layers(layer_groups(kv, layout.regions))
        shard = copier.segment.shard(0)
        shard[[2, 5, 7]] = np.random.default_rng(3).integers(1, 256, (3, 1024), dtype=np.uint8)
        load = copier.submit_layered([ShardJob(11, LOAD, np.array([20, 21, 22]), np.array([2, 5, 7]))])
        load.wait_layer("l0", 10)
        assert np.array_equal(kv["l0"][[20, 21, 22]].numpy(), shard[[2, 5, 7], :256])
        copier.wait([11], 10)
        assert copier.poll() == ([11], [])
        for i, name in enumerate(LAYERS):
            assert np.array_equal(kv[name][[20, 21, 22]].numpy(), shard[[2, 5, 7], 256 * i : 256 * (i + 1)])
    finally:
        copier.close()


def test_one_region_group_is_not_layered(tmp_path):
    kv = {"kv": torch.zeros(64, 1024, dtype=torch.uint8)}
    layout = tkv.KVLayout.from_tensors(kv, 64)
    copier = ShardCopier(layout, rank=0, world_size=WORLD)
    copier.open(segment_info_for(config(tmp_path), layout, world_size=WORLD, engine_id="one"))
    try:
        assert not copier.enable_layers(layer_groups(kv, layout.regions))
        with pytest.raises(TransferError):
            copier.submit_layered([])
    finally:
        copier.close()
