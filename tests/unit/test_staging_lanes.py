"""Defect D (issue 27) on the CPU: staging alternates two buffers chunk by chunk, every chunk's kernel and
DMA go through their lanes with the waits that let them overlap on two streams safely, and the batches'
index ids come from a preallocated ring that never hands out a stretch a pending batch still reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv.transfer.engines.index_ring import IndexRing
from tiered_kv.transfer.engines.staged import Lanes, Staging, enqueue_load, enqueue_store, host_slabs

WIDTHS = (64, 300, 8)


class Recording(Lanes):
    """Lanes that log each hook, and check the rule two streams rely on: a lane uses buffer b only after
    the other lane finished its latest use of b (here in program order, so the log must show it)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.lane: str | None = None
        self.finished = 0

    def _in(self, lane: str):
        rec = self

        class _Ctx:
            def __enter__(self):
                rec.lane = lane

            def __exit__(self, *exc):
                rec.lane = None

        return _Ctx()

    def kernel(self):
        return self._in("kernel")

    def dma(self):
        return self._in("dma")

    def before(self, lane: str, b: int) -> None:
        assert self.lane == lane
        other = "dma" if lane == "kernel" else "kernel"
        uses = [(op, ln) for ln, op, bb in self.log if bb == b]
        if uses:  # the previous use of b was the other lane's, and it is finished
            assert uses[-1] == ("after", other), (lane, b, self.log)
        self.log.append((lane, "before", b))

    def after(self, lane: str, b: int) -> None:
        assert self.lane == lane
        self.log.append((lane, "after", b))

    def finish(self) -> None:
        self.finished += 1


def rig(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gpu = [torch.randint(0, 256, (24, w), dtype=torch.uint8, generator=gen) for w in WIDTHS]
    slab = torch.zeros((24, sum(WIDTHS)), dtype=torch.uint8)
    cpu = list(torch.split(slab, list(WIDTHS), dim=1))
    return gpu, cpu


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
def test_chunks_alternate_two_buffers_through_their_lanes_byte_exact(store):
    gpu, cpu = rig()
    if not store:
        for c in cpu:
            c.copy_(torch.randint(0, 256, c.shape, dtype=torch.uint8))
    slots = np.arange(2, 12, dtype=np.int64)
    gpu_ids = np.array([17, 1, 5, 23, 0, 11, 3, 9, 14, 20], dtype=np.int64)
    staging, lanes = Staging(torch.device("cpu"), 2 * sum(WIDTHS)), Recording()  # two rows a chunk: 5 chunks
    if store:
        enqueue_store(gpu, host_slabs(cpu), gpu_ids, slots, staging, torch.from_numpy, lanes=lanes)
    else:
        enqueue_load(gpu, host_slabs(cpu), slots, gpu_ids, staging, torch.from_numpy, lanes=lanes)
    first, second = ("kernel", "dma") if store else ("dma", "kernel")
    want = []
    for chunk in range(5):
        b = chunk % 2
        want += [(first, "before", b), (first, "after", b), (second, "before", b), (second, "after", b)]
    assert lanes.log == want and lanes.finished == 1
    assert len(staging.buffers) == 2 and staging.buffers[0].data_ptr() != staging.buffers[1].data_ptr()
    for g, c in zip(gpu, cpu, strict=True):
        if store:
            assert torch.equal(c[torch.from_numpy(slots)], g[torch.from_numpy(gpu_ids)])
        else:
            assert torch.equal(g[torch.from_numpy(gpu_ids)], c[torch.from_numpy(slots)])


def test_a_failure_part_way_still_finishes_the_lanes():
    """The done event is recorded on the kernel stream: it must wait for DMAs already queued."""

    class Failing(Staging):
        def view(self, rows, width):
            if self.last == 0:  # the second chunk
                raise RuntimeError("staging failed")
            return super().view(rows, width)

    gpu, cpu = rig()
    lanes = Recording()
    with pytest.raises(RuntimeError, match="staging failed"):
        enqueue_store(gpu, host_slabs(cpu), np.array([5, 1, 7, 3]), np.array([0, 1, 2, 3]),
                      Failing(torch.device("cpu"), 2 * sum(WIDTHS)), torch.from_numpy, lanes=lanes)  # fmt: skip
    assert lanes.finished == 1 and [e[0] for e in lanes.log] == ["kernel", "kernel", "dma", "dma"]


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_the_index_ring_reuses_a_stretch_only_once_its_batch_is_done():
    ring = IndexRing(10, pin=False)
    e1, e2, e3 = Event(), Event(), Event()
    a = ring.take(np.arange(4))
    ring.seal(e1)
    b = ring.take(np.arange(100, 105))
    ring.seal(e2)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == list(range(100, 105))
    assert ring.take(np.arange(3)) is None and ring.fallbacks == 1  # 1 free at the end, [0, 4) still read
    e1.done = True
    c = ring.take(np.arange(200, 203))  # wraps to the start, where batch 1's ids were
    assert c.data_ptr() == a.data_ptr() and b.tolist() == list(range(100, 105))  # batch 2's ids untouched
    ring.seal(e3)
    assert ring.take(np.arange(2)) is None  # [3, 4) free only: 1 slot
    e2.done = e3.done = True
    d = ring.take(np.arange(10))  # all done: the whole ring again
    assert d.tolist() == list(range(10)) and ring.take(np.arange(11)) is None


def test_the_index_ring_is_allocated_once():
    ring = IndexRing(64, pin=False)
    ptr = ring.buf.data_ptr()
    for i in range(100):
        ev = Event()
        view = ring.take(np.full(7, i))
        assert view is not None and ring.buf.data_ptr() == ptr
        assert ptr <= view.data_ptr() < ptr + 64 * 8
        ring.seal(ev)
        ev.done = True
    assert ring.fallbacks == 0
