"""The direct road's copy plan (native/copy_plan.hpp) against a small Python reference (issue 46).

Addresses are plain integers here (no memory behind them): a descriptor is checked by where its bytes
land, counted per byte of a modelled GPU and slab address space.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_core.copy_ids import check_copy_ids as reference_check

from tiered_kv.core import core
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.base import check_id_arrays

GPU_BASE, HOST_BASE = 1 << 32, 1 << 40


@st.composite
def geometries(draw):
    """(regions, num_blocks, num_slots): one packed region, or several in a block-major slab (or one slab each)."""
    num_blocks = draw(st.integers(1, 24))
    num_slots = draw(st.integers(1, 24))
    widths = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    slab = draw(st.sampled_from(["block-major", "separate"]))
    regions, gpu_at, host_at = [], GPU_BASE, HOST_BASE
    for r, w in enumerate(widths):
        pad = draw(st.sampled_from([0, 0, 8]))  # a GPU row stride above the row: not dense, never merged
        if slab == "block-major":
            regions.append((gpu_at, w + pad, w, HOST_BASE, sum(widths), sum(widths[:r])))
        else:
            regions.append((gpu_at, w + pad, w, host_at, w, 0))
            host_at += num_slots * w + 64
        gpu_at += num_blocks * (w + pad) + 64
    return regions, num_blocks, num_slots


@st.composite
def calls(draw):
    regions, num_blocks, num_slots = draw(geometries())
    n = draw(st.integers(0, min(num_blocks, num_slots)))
    kind = draw(st.sampled_from(["scattered", "contiguous", "reversed"]))
    if kind == "scattered":
        gpu = draw(st.permutations(range(num_blocks)))[:n]
        slots = draw(st.permutations(range(num_slots)))[:n]
    else:
        g0 = draw(st.integers(0, num_blocks - n))
        s0 = draw(st.integers(0, num_slots - n))
        gpu, slots = list(range(g0, g0 + n)), list(range(s0, s0 + n))
        if kind == "reversed":
            gpu, slots = gpu[::-1], slots[::-1]
    dma_rows = draw(st.sampled_from([0, 1, 2, 3, 5, 64]))
    return regions, num_blocks, num_slots, np.array(gpu, np.int64), np.array(slots, np.int64), dma_rows


def reference_runs(gpu: np.ndarray, slots: np.ndarray, dma_rows: int) -> int:
    """Maximal runs consecutive in both ids, in slot order, cut where a slot is a multiple of dma_rows."""
    order = np.argsort(slots, kind="stable")
    g, s = gpu[order].tolist(), slots[order].tolist()
    runs = 0
    for i in range(len(s)):
        joins = i > 0 and s[i] == s[i - 1] + 1 and g[i] == g[i - 1] + 1 and not (dma_rows and s[i] % dma_rows == 0)
        runs += not joins
    return runs


@settings(max_examples=300, deadline=None)
@given(calls(), st.booleans())
def test_every_byte_is_covered_once_by_maximal_runs(call, store):
    regions, num_blocks, num_slots, gpu, slots, dma_rows = call
    src, dst, nbytes = core.direct_plan(regions, gpu, slots, store, dma_rows)
    gpu_side, host_side = (src, dst) if store else (dst, src)
    # Where each descriptor's bytes come from and go to, byte by byte: (block, region, offset) on both sides.
    block_of = dict(zip(slots.tolist(), gpu.tolist(), strict=True))
    seen: dict[tuple[int, int, int], int] = {}
    for g_addr, h_addr, n in zip(gpu_side.tolist(), host_side.tolist(), nbytes.tolist(), strict=True):
        assert n > 0
        r = next(i for i, reg in enumerate(regions) if reg[0] <= g_addr < reg[0] + num_blocks * reg[1])
        g0, gstride, width, h0, hstride, col = regions[r]
        for k in range(n):
            block, off = divmod(g_addr + k - g0, gstride)
            slot, hoff = divmod(h_addr + k - h0 - col, hstride)
            assert off < width and hoff == off, f"byte {k} of a descriptor leaves region {r}'s row"
            assert block_of.get(slot) == block, f"slot {slot} got block {block}'s bytes"
            seen[(block, r, off)] = seen.get((block, r, off), 0) + 1
        # No descriptor crosses a multiple of dma_rows slab rows.
        if dma_rows:
            first, last = (h_addr - h0 - col) // hstride, (h_addr - h0 - col + n - 1) // hstride
            assert first // dma_rows == last // dma_rows
    expected = {(int(b), r, o) for b in gpu for r, reg in enumerate(regions) for o in range(reg[2])}
    assert set(seen) == expected and all(v == 1 for v in seen.values())
    # Total bytes: every (block, region) exactly once.
    assert int(nbytes.sum()) == len(gpu) * sum(reg[2] for reg in regions)
    # Descriptors: a maximal run per dense region, one per row elsewhere.
    runs = reference_runs(gpu, slots, dma_rows)
    dense = sum(1 for reg in regions if reg[1] == reg[2] == reg[4])
    assert len(nbytes) == dense * runs + (len(regions) - dense) * len(gpu)


def test_a_packed_region_is_one_descriptor_per_run_cut_at_dma_rows():
    regions = [(GPU_BASE, 1 << 19, 1 << 19, HOST_BASE, 1 << 19, 0)]  # 512 KiB packed rows
    gpu = np.arange(10, 74, dtype=np.int64)
    slots = np.arange(0, 64, dtype=np.int64)
    src, dst, nbytes = core.direct_plan(regions, gpu, slots, True, 0)
    assert (len(src), int(nbytes[0]), int(src[0]), int(dst[0])) == (1, 64 << 19, GPU_BASE + (10 << 19), HOST_BASE)
    src, dst, nbytes = core.direct_plan(regions, gpu, slots + 8, False, 32)  # slots 8..71: cut at 32 and 64
    assert nbytes.tolist() == [24 << 19, 32 << 19, 8 << 19]
    assert dst.tolist() == [GPU_BASE + (10 << 19), GPU_BASE + (34 << 19), GPU_BASE + (66 << 19)]


@pytest.mark.parametrize(
    ("src", "dst", "src_len", "dst_len"),
    [([1, 2], [3], 8, 8), ([1, 9], [0, 1], 8, 8), ([-1], [0], 8, 8), ([0], [8], 8, 8), ([0, 1, 2], [5, 3, 5], 8, 8),
     ([0, 1], [2, 2], 8, 8), ([0.5], [1], 8, 8), ([[1]], [[1]], 8, 8)],
)
def test_refusals_word_what_check_id_arrays_says(src, dst, src_len, dst_len):
    with pytest.raises(TransferError) as py_err:
        reference_check(src, dst, src_len, dst_len, "gpu block id", "cpu slot")
    with pytest.raises(TransferError) as native_err:
        check_id_arrays(np.asarray(src), np.asarray(dst), src_len=src_len, dst_len=dst_len, src_name="gpu block id",
                        dst_name="cpu slot")  # fmt: skip
    assert str(native_err.value) == str(py_err.value)


def test_empty_call_plans_nothing():
    src, dst, nbytes = core.direct_plan([(GPU_BASE, 16, 16, HOST_BASE, 16, 0)], [], [], True, 4)
    assert len(src) == len(dst) == len(nbytes) == 0
