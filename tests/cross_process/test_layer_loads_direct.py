"""Layer-wise synchronous loads on CUDA (issue 46 item 9) over the native fake driver: one mark (event) per
layer group on the load stream, the model's stream waits for its layer's mark only, and the last block of
each job lands whole before any layer group (a hit that ends inside a block)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from scheduler_helpers import WORLD, config

import tiered_kv as tkv
from tiered_kv.core import core
from tiered_kv.cross_process import LOAD, ShardCopier, ShardJob, layer_groups, segment_info_for
from tiered_kv.cross_process.layer_loads_direct import DirectLayerLoads
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.direct import RawHandle

fake = core.fake_cuda
LAYERS = ["l0", "l1", "l2", "l3"]


@pytest.fixture(autouse=True)
def no_leaks():
    before = fake.live()
    yield
    assert fake.live() == before, "a test left fake events or streams behind"


@pytest.fixture
def model():
    stream = fake.stream_create()
    marks = [fake.event_create() for _ in range(3)]
    yield stream, marks
    for e in marks:
        fake.event_destroy(e)
    fake.stream_destroy(stream)


def rig(max_inflight: int = 4):
    kv = {name: torch.zeros(64, 256, dtype=torch.uint8) for name in LAYERS}
    layout = tkv.KVLayout.from_tensors(kv, 64)
    slab = torch.randint(1, 256, (16, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    cpu = [slab[:, 256 * i : 256 * (i + 1)] for i in range(4)]
    groups = layer_groups(kv, layout.regions)
    layers = DirectLayerLoads(layout.regions, cpu, groups, driver="fake:13000", max_inflight=max_inflight)
    return kv, cpu, layers


JOBS = [ShardJob(3, LOAD, np.array([40, 41, 42]), np.array([3, 4, 5])), ShardJob(4, LOAD, np.array([9, 8]), np.array([0, 1]))]


def test_the_models_stream_waits_for_its_layers_mark_only(model):
    stream, (after0, after2, after_all) = model
    kv, cpu, layers = rig()
    finished: list[tuple[int, bool]] = []
    try:
        hold = layers.stream_handle
        fake.hold(hold)
        fake.reset_counts()
        load = layers.start(JOBS, lambda j, ok: finished.append((j, ok)))
        counts = fake.counts()  # edges + 4 layer groups: 5 batches, 5 marks and the done event
        assert (counts["batch"], counts["record"], layers.num_groups) == (5, 6, 4)
        fake.step(hold, 1)  # the edge blocks only
        for i, name in enumerate(LAYERS):  # the last block of each job landed whole, nothing else yet
            assert torch.equal(kv[name][[42, 8]], cpu[i][[5, 1]])
            assert not kv[name][[40, 41, 9]].any()
        fake.step(hold, 1)  # layer group 0
        fake.reset_counts()
        load.wait_edges(stream=RawHandle(stream))
        load.wait_layer("l0", stream=RawHandle(stream))
        fake.record(after0, stream)
        load.wait_layer("l2", stream=RawHandle(stream))
        fake.record(after2, stream)
        load.wait_layer("no such layer", stream=RawHandle(stream))  # the whole load
        fake.record(after_all, stream)
        assert fake.counts()["wait"] == 4, "one stream wait per call, on one mark"
        assert fake.query(after0) and not fake.query(after2), "layer 0 waited for more than its own rows"
        assert torch.equal(kv["l0"][[40, 41, 42, 9, 8]], cpu[0][[3, 4, 5, 0, 1]]) and not kv["l2"][[40, 9]].any()
        fake.step(hold, 2)  # groups 1 and 2
        assert fake.query(after2) and not fake.query(after_all)
        assert layers.poll() == [] and finished == []
        fake.hold(hold, False)
        assert layers.wait(5) == [3, 4] and finished == [(3, True), (4, True)]
        assert fake.query(after_all)
        for i, name in enumerate(LAYERS):
            assert torch.equal(kv[name][[40, 41, 42, 9, 8]], cpu[i][[3, 4, 5, 0, 1]])
    finally:
        fake.hold(layers.stream_handle, False)
        layers.close()


def test_a_landed_load_needs_no_stream_wait(model):
    stream, _ = model
    kv, cpu, layers = rig()
    try:
        load = layers.start(JOBS[:1], lambda j, ok: None)
        layers.wait(5)
        fake.reset_counts()
        load.wait_layer("l3", stream=RawHandle(stream))
        assert fake.counts().get("wait", 0) == 0
        assert torch.equal(kv["l3"][[40, 41, 42]], cpu[3][[3, 4, 5]])
    finally:
        layers.close()


def test_a_parked_layered_load_is_waited_for_until_issued(model):
    stream, (after, _, _) = model
    kv, cpu, layers = rig(max_inflight=1)
    reported: list[tuple[int, bool]] = []
    try:
        fake.hold(layers.stream_handle)
        layers.start(JOBS[:1], lambda j, ok: reported.append((j, ok)))
        second = layers.start(JOBS[1:], lambda j, ok: reported.append((j, ok)))
        with pytest.raises(TransferError, match="layer 'l1' of a synchronous load not issued after 0.05 s"):
            second.wait_layer("l1", 0.05, stream=RawHandle(stream))
        fake.step(layers.stream_handle, 6)  # the first load's 5 marks and done: the second is issued
        second.wait_layer("l1", 5, stream=RawHandle(stream))
        fake.record(after, stream)
        fake.hold(layers.stream_handle, False)
        assert layers.wait(5) == [3, 4] and reported == [(3, True), (4, True)] and fake.query(after)
        assert torch.equal(kv["l1"][[9, 8]], cpu[1][[0, 1]])
    finally:
        fake.hold(layers.stream_handle, False)
        layers.close()


def test_a_failed_copy_reports_its_jobs_failed_and_the_next_load_goes_on():
    kv, cpu, layers = rig()
    reported: list[tuple[int, bool]] = []
    try:
        fake.fail_batches(1)
        layers.start(JOBS[:1], lambda j, ok: reported.append((j, ok)))
        layers.start(JOBS[1:], lambda j, ok: reported.append((j, ok)))
        layers.wait(5)
        assert reported == [(3, False), (4, True)]
        assert torch.equal(kv["l2"][[9, 8]], cpu[2][[0, 1]])
    finally:
        layers.close()


def test_bad_ids_refuse_the_load_and_queue_nothing():
    _, _, layers = rig()
    try:
        fake.reset_counts()
        with pytest.raises(TransferError, match="cpu slot 99 out of range"):
            layers.start([ShardJob(1, LOAD, np.array([1]), np.array([99]))], lambda j, ok: None)
        assert fake.counts().get("batch", 0) == 0 and layers.poll() == []
    finally:
        layers.close()


class FakeRoadCopier(ShardCopier):
    """A host rank whose layered loads take the direct road's marks on the fake driver, as a CUDA rank's
    direct road does on a GPU (ShardCopier._layered_loads); the rest of its copies stay on the host engine."""

    def _layered_loads(self, groups):
        self.built = DirectLayerLoads(list(self.layout.regions), self._cpu_regions, groups, driver="fake:13000")
        return self.built


def test_the_copier_reports_direct_layered_loads_through_poll_wait_and_pending(tmp_path):
    kv = {name: torch.zeros(64, 256, dtype=torch.uint8) for name in LAYERS}
    layout = tkv.KVLayout.from_tensors(kv, 64)
    copier = FakeRoadCopier(layout, rank=0, world_size=WORLD)
    copier.open(segment_info_for(config(tmp_path), layout, world_size=WORLD, engine_id="direct-layers"))
    held = None
    try:
        assert copier.enable_layers(layer_groups(kv, layout.regions))
        held = copier.built.stream_handle
        shard = copier.segment.shard(0)
        shard[[2, 5, 7]] = np.random.default_rng(3).integers(1, 256, (3, 1024), dtype=np.uint8)
        fake.hold(held)
        copier.submit_layered([ShardJob(11, LOAD, np.array([20, 21, 22]), np.array([2, 5, 7]))])
        assert copier.pending == 1 and copier.poll() == ([], [])
        with pytest.raises(TransferError, match=r"jobs \[11\] still copying after 0.05 s"):
            copier.wait([11], 0.05)
        release = threading.Timer(0.05, fake.hold, (held, False))  # lands while the copier waits for it
        release.start()
        copier.wait([11], 10)  # blocks in the loads' own wait, then reports: no thread of theirs calls back
        release.join()
        assert copier.poll() == ([11], []) and copier.pending == 0
        # Without a wait: pending and poll read the marks themselves.
        copier.submit_layered([ShardJob(12, LOAD, np.array([30]), np.array([5]))])
        deadline = time.monotonic() + 10
        while copier.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert copier.pending == 0 and copier.poll() == ([12], [])
        for i, name in enumerate(LAYERS):
            assert np.array_equal(kv[name][[20, 21, 22]].numpy(), shard[[2, 5, 7], 256 * i : 256 * (i + 1)])
    finally:
        if held is not None:
            fake.hold(held, False)
        copier.close()
