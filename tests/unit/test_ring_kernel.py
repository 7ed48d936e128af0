"""The staged road (issue 46 item 3): the capped persistent gather/scatter kernel under TRITON_INTERPRET=1 on
CPU tensors, and the ring plan (native/ring_plan.hpp) that cuts a call into staging chunks and descriptors.
A whole staged call runs here as it would on a GPU: kernel into the chunk, then the chunk's descriptors
(executed with memmove), ring buffer k % 4 for chunk k."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.core import core
from tiered_kv.errors import LayoutError, TransferError
from tiered_kv.transfer.engines import ring_kernel, table_kernel

needs_triton = pytest.mark.skipif(not table_kernel.available(), reason="triton is not installed (pip install -e '.[kernel]')")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def layout(widths, num_blocks=11, num_slots=9, seed=0, pad=0):
    """GPU regions (rows ``pad`` bytes wider than their width: a view) and one block-major slab's regions."""
    gen = torch.Generator().manual_seed(seed)
    gpu = [torch.randint(0, 256, (num_blocks, w + pad), dtype=torch.uint8, generator=gen)[:, :w] for w in widths]
    slab = torch.zeros(num_slots, sum(widths), dtype=torch.uint8)
    return gpu, list(torch.split(slab, list(widths), dim=1)), slab


def reference_rows(gpu, ids):
    return torch.cat([g[torch.as_tensor(ids)] for g in gpu], dim=1)


@needs_triton
@pytest.mark.parametrize(("widths", "programs"), [((3, 17, 1000), 16), ((4097,), 3), ((8, 24, 40), 1), ((2, 6), 16)])
@pytest.mark.parametrize("n", [1, 7])
def test_gather_then_scatter_are_bit_exact_with_odd_sizes(interpret, widths, programs, n):
    gpu, cpu, _ = layout(widths, pad=5)
    table = ring_kernel.ring_table(gpu, cpu)
    ids = torch.tensor([10, 0, 3, 7, 4, 9, 1][:n], dtype=torch.int64)
    chunk = torch.full((n, sum(widths)), 0xEE, dtype=torch.uint8)
    ring_kernel.launch(table, ids, chunk.data_ptr(), n, load=False, programs=programs)
    assert torch.equal(chunk, reference_rows(gpu, ids))
    before = [g.clone() for g in gpu]
    for g in gpu:
        g.zero_()
    back = torch.tensor([5, 6, 2, 8, 0, 1, 3][:n], dtype=torch.int64)
    ring_kernel.launch(table, back, chunk.data_ptr(), n, load=True, programs=programs)
    for g, b in zip(gpu, before, strict=True):
        assert torch.equal(g[back], b[ids])
        others = torch.ones(g.shape[0], dtype=torch.bool)
        others[back] = False
        assert not g[others].any(), "the scatter wrote rows outside its blocks"


@needs_triton
def test_the_widest_aligned_element_is_used(interpret):
    assert ring_kernel.ring_table(*layout((64, 128))[:2]).bits == 64
    assert ring_kernel.ring_table(*layout((6, 10))[:2]).bits == 16
    assert ring_kernel.ring_table(*layout((3, 10))[:2]).bits == 8
    table = ring_kernel.ring_table(*layout((64, 128))[:2])
    with pytest.raises(TransferError, match="not aligned to 8 bytes"):
        ring_kernel.launch(table, torch.zeros(1, dtype=torch.int64), 0x1001, 1, load=False)


def test_the_staged_road_needs_one_slab():
    gpu = [torch.zeros(4, 8, dtype=torch.uint8)] * 2
    with pytest.raises(LayoutError, match="one block-major slab, got 2 slabs"):
        ring_kernel.ring_table(gpu, [torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.uint8)])


def test_the_road_and_its_threshold_are_named():
    small = [torch.zeros(2, 32 << 10, dtype=torch.uint8)] * 64
    assert ring_kernel.ring_road(small) == "staged(min_row=1048576,ring=4x8MiB,programs=16)"
    assert ring_kernel.ring_road([torch.zeros(2, 2 << 20, dtype=torch.uint8)] * 2) == "direct(min_row=1048576)"
    assert ring_kernel.ring_road([torch.zeros(2, 4096, dtype=torch.uint8)]) == "direct(min_row=1048576)"  # packed
    assert ring_kernel.ring_road(small, min_row=16 << 10).startswith("direct")


def memmoves(src, dst, nbytes):
    for s, d, b in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
        ctypes.memmove(d, s, b)


@needs_triton
@pytest.mark.parametrize("dma_rows", [0, 4])
def test_a_staged_call_through_a_ring_of_four_chunks_round_trips(interpret, dma_rows):
    widths = (40, 24, 8)
    gpu, cpu, slab = layout(widths, num_blocks=40, num_slots=32, seed=3)
    table = ring_kernel.ring_table(gpu, cpu)
    ring = [torch.zeros(3, sum(widths), dtype=torch.uint8) for _ in range(4)]  # 3 rows a chunk: the ring wraps
    rng = np.random.default_rng(0)
    ids, slots = rng.permutation(40)[:20], np.concatenate([np.arange(2, 12), rng.permutation(np.arange(12, 32))[:10]])
    addrs = [r.data_ptr() for r in ring]
    order, starts, chunk_of, src, dst, nbytes = core.ring_plan(ids, slots, True, slab.data_ptr(), slab.stride(0),
                                                             sum(widths), addrs, 3, dma_rows)  # fmt: skip
    assert len(starts) == 8 and starts[-1] == 20  # 7 chunks of <= 3 rows
    for k in range(7):  # chunk k: gather into ring[k % 4], then its descriptors (in stream order)
        rows = torch.as_tensor(order[starts[k] : starts[k + 1]])
        ring_kernel.launch(table, rows, addrs[k % 4], len(rows), load=False)
        mine = chunk_of == k
        memmoves(src[mine], dst[mine], nbytes[mine])
    assert torch.equal(slab[torch.as_tensor(slots)], reference_rows(gpu, ids))
    before = [g.clone() for g in gpu]
    for g in gpu:
        g.zero_()
    back = rng.permutation(40)[:20]
    order, starts, chunk_of, src, dst, nbytes = core.ring_plan(back, slots, False, slab.data_ptr(), slab.stride(0),
                                                             sum(widths), addrs, 3, dma_rows)  # fmt: skip
    for k in range(7):  # load: the chunk's descriptors first, then the scatter out of it
        mine = chunk_of == k
        memmoves(src[mine], dst[mine], nbytes[mine])
        rows = torch.as_tensor(order[starts[k] : starts[k + 1]])
        ring_kernel.launch(table, rows, addrs[k % 4], len(rows), load=True)
    for g, b in zip(gpu, before, strict=True):
        assert torch.equal(g[torch.as_tensor(back)], b[torch.as_tensor(ids)])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_ring_plan_covers_every_row_once_in_maximal_runs_within_chunks(data):
    n = data.draw(st.integers(0, 40))
    slots = np.array(data.draw(st.permutations(range(48)))[:n], dtype=np.int64)
    ids = np.arange(n, dtype=np.int64) + 100
    chunk_rows, nring = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 4))
    dma_rows, row, store = data.draw(st.sampled_from([0, 3, 8])), 16, data.draw(st.booleans())
    ring = [1 << 40 | k << 20 for k in range(nring)]
    slab = 1 << 30
    order, starts, chunk_of, src, dst, nbytes = core.ring_plan(ids, slots, store, slab, row, row, ring, chunk_rows, dma_rows)
    assert starts.tolist() == [*range(0, n, chunk_rows), n] if n else starts.tolist() == [0]
    by_slot = np.argsort(slots, kind="stable")
    assert order.tolist() == ids[by_slot].tolist()
    staged, slabbed = (src, dst) if store else (dst, src)
    covered = []
    for i in range(len(nbytes)):
        k, rows = int(chunk_of[i]), int(nbytes[i]) // row
        first = (int(staged[i]) - ring[k % nring]) // row  # its first row within chunk k
        assert 0 <= first and first + rows <= starts[k + 1] - starts[k], "a descriptor leaves its chunk"
        s0 = (int(slabbed[i]) - slab) // row
        assert dma_rows == 0 or (s0 // dma_rows) == ((s0 + rows - 1) // dma_rows), "a descriptor crosses dma_rows"
        covered += [(starts[k] + first + j, s0 + j) for j in range(rows)]
        assert slots[by_slot][starts[k] + first : starts[k] + first + rows].tolist() == list(range(s0, s0 + rows))
    assert sorted(covered) == [(j, int(slots[by_slot][j])) for j in range(n)], "rows not covered exactly once"
    sorted_slots = slots[by_slot]
    joins = sum(1 for j in range(1, n) if j % chunk_rows and sorted_slots[j] == sorted_slots[j - 1] + 1
                and (dma_rows == 0 or sorted_slots[j] % dma_rows))  # fmt: skip
    assert len(nbytes) == n - joins, "runs are not maximal"


def test_a_bad_ring_is_refused():
    with pytest.raises(TransferError, match="need >= 1 buffer"):
        core.ring_plan([1], [1], True, 0, 16, 16, [], 4)
    with pytest.raises(TransferError, match="stride >= row"):
        core.ring_plan([1], [1], True, 0, 8, 16, [0], 4)
