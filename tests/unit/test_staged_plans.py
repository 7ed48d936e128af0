"""Copy plans of the staged and table paths, on CPU tensors: what the CUDA engine enqueues, checked against naive copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tiered_kv.core import core
from tiered_kv.errors import LayoutError
from tiered_kv.layout import KVLayout
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.transfer.engines.staged import Staging, enqueue_load, enqueue_store, gpu_groups, host_slabs

fake_cuda = core.fake_cuda


def copies(draw):
    src_len = draw(st.integers(1, 24))
    dst_len = draw(st.integers(1, 24))
    n = draw(st.integers(0, dst_len))
    dst = draw(st.permutations(range(dst_len)))[:n]
    src = draw(st.lists(st.integers(0, src_len - 1), min_size=n, max_size=n))
    row_bytes = draw(st.sampled_from([1, 3, 8, 12, 64]))
    bytes_per_block = draw(st.sampled_from([0, 16, 4096, 1 << 22]))
    return src, dst, src_len, dst_len, row_bytes, bytes_per_block


def cpu_side(layout: str, widths, num_slots: int, order, gen):
    """CPU regions: column views of one block-major slab (regions placed in ``order``), or separate tensors."""
    if layout == "separate":
        return [torch.randint(0, 256, (num_slots, w), dtype=torch.uint8, generator=gen) for w in widths], None
    slab = torch.randint(0, 256, (num_slots, sum(widths)), dtype=torch.uint8, generator=gen)
    offsets, pos = [0] * len(widths), 0
    for r in order:  # region r's columns need not follow region r-1's
        offsets[r], pos = pos, pos + widths[r]
    return [slab[:, o : o + w] for o, w in zip(offsets, widths, strict=True)], slab


def _drawn_ids(draw, universe: int, n: int, unique: bool) -> list[int]:
    pattern = draw(st.sampled_from(["scattered", "run", "rotated_run", "sorted"]))
    if pattern in ("run", "rotated_run") and n <= universe:
        start = draw(st.integers(0, universe - n))
        ids = list(range(start, start + n))
        k = draw(st.integers(0, n)) if pattern == "rotated_run" else 0
        return ids[k:] + ids[:k]  # two runs, out of order
    if unique:
        ids = draw(st.permutations(range(universe)))[:n]
    else:
        ids = draw(st.lists(st.integers(0, universe - 1), min_size=n, max_size=n))
    return sorted(ids) if pattern == "sorted" else ids


@st.composite
def engine_copies(draw):
    widths = draw(st.lists(st.sampled_from([1, 3, 8, 40, 64, 300, 4096]), min_size=1, max_size=4))
    num_blocks, num_slots = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    store = draw(st.booleans())
    # Destinations are distinct (the engine validates that); sources may repeat.
    src_len, dst_len = (num_blocks, num_slots) if store else (num_slots, num_blocks)
    n = draw(st.integers(0, dst_len))
    src = _drawn_ids(draw, src_len, n, unique=False)
    dst = _drawn_ids(draw, dst_len, n, unique=True)
    order = draw(st.permutations(range(len(widths))))
    return widths, num_blocks, num_slots, store, src, dst, order


@settings(max_examples=200, deadline=None)
@given(engine_copies(), st.sampled_from([1, 100, 4096, 1 << 30]), st.sampled_from(["slab", "separate"]),
       st.sampled_from([None, 1, 2, 3, 7]))  # fmt: skip
def test_cuda_enqueue_logic_matches_naive_copy(case, staging_limit, layout, dma_rows):
    widths, num_blocks, num_slots, store, src_ids, dst_ids, order = case
    gen = torch.Generator().manual_seed(len(src_ids) + 7 * len(widths))
    gpu = [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]
    cpu, _ = cpu_side(layout, widths, num_slots, order, gen)
    slabs = host_slabs(cpu)
    assert len(slabs) == (1 if layout == "slab" or len(widths) == 1 else len(widths))
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    expected = [d.clone() for d in dst]
    for s, d in zip(src, expected, strict=True):
        for i, j in zip(src_ids, dst_ids, strict=True):
            d[j] = s[i]
    staging = Staging(torch.device("cpu"), staging_limit)
    src_arr, dst_arr = np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)
    if store:
        enqueue_store(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy, dma_rows)
    else:
        enqueue_load(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy, dma_rows)
    for r, (got, want) in enumerate(zip(dst, expected, strict=True)):
        assert torch.equal(got, want), f"region {r} differs from the per-row copy"


class HostCopies(TorchDispatchMode):
    """Records every non-view op that reads or writes one host buffer (a real dispatch hook, not a mock)."""

    def __init__(self, host: torch.Tensor) -> None:
        super().__init__()
        self.ptr = host.untyped_storage().data_ptr()
        self.ops: list[tuple[str, list[tuple[int, ...]], list[bool]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:
            tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
            on_host = [t for t in tensors if t.untyped_storage().data_ptr() == self.ptr]
            if on_host:
                shapes = [tuple(t.shape) for t in on_host]
                self.ops.append((str(func), shapes, [t.is_contiguous() for t in on_host]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize(("staging_limit", "runs"), [(1 << 20, [3, 2, 1]), (2 * 372, [2, 1, 1, 1, 1])])
def test_block_major_host_side_is_one_contiguous_copy_per_run(store, staging_limit, runs):
    # Strided host copies are what the block-major path exists to avoid: every
    # op touching the slab must be a plain copy_ of whole contiguous rows, one
    # per run of consecutive slots (split where a staging chunk ends).
    widths, num_blocks = (64, 300, 8), 24
    gen = torch.Generator().manual_seed(3)
    gpu = [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]
    cpu, slab = cpu_side("slab", widths, 24, [2, 0, 1], gen)
    slots = np.array([9, 10, 2, 3, 4, 20], dtype=np.int64)  # runs 2-4, 9-10, 20
    gpu_ids = np.array([17, 1, 5, 23, 0, 11], dtype=np.int64)
    before = [t.clone() for t in (cpu if store else gpu)]
    slabs, staging = host_slabs(cpu), Staging(torch.device("cpu"), staging_limit)
    with HostCopies(slab) as seen:
        if store:
            enqueue_store(gpu, slabs, gpu_ids, slots, staging, torch.from_numpy)
        else:
            enqueue_load(gpu, slabs, slots, gpu_ids, staging, torch.from_numpy)
    assert [op for op, _, _ in seen.ops] == ["aten.copy_.default"] * len(runs)
    assert [shapes for _, shapes, _ in seen.ops] == [[(n, sum(widths))] for n in runs]
    assert all(all(contig) for _, _, contig in seen.ops)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    for s, d, b in zip(src, dst, before, strict=True):
        want = b.clone()
        want[torch.from_numpy(slots if store else gpu_ids)] = s[torch.from_numpy(gpu_ids if store else slots)]
        assert torch.equal(d, want)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("widths", [(64, 300, 8), (512,)], ids=["staged", "direct"])
def test_no_dma_crosses_a_registered_chunk_edge(store, widths):
    # The slab is registered in chunks of 4 rows here: the run of slots 2-9 becomes 2-3, 4-7, 8-9.
    gen = torch.Generator().manual_seed(5)
    gpu = [torch.randint(0, 256, (24, w), dtype=torch.uint8, generator=gen) for w in widths]
    cpu, slab = cpu_side("slab", widths, 16, list(range(len(widths))), gen)
    slab = slab if slab is not None else cpu[0]
    slots = np.array([2, 3, 4, 5, 6, 7, 8, 9], dtype=np.int64)
    gpu_ids = np.arange(10, 18, dtype=np.int64)  # consecutive: single-region slabs copy directly
    before = [t.clone() for t in (cpu if store else gpu)]
    slabs, staging = host_slabs(cpu), Staging(torch.device("cpu"), 1 << 20)
    with HostCopies(slab) as seen:
        if store:
            enqueue_store(gpu, slabs, gpu_ids, slots, staging, torch.from_numpy, 4)
        else:
            enqueue_load(gpu, slabs, slots, gpu_ids, staging, torch.from_numpy, 4)
    assert [shapes[0][0] for _, shapes, _ in seen.ops] == [2, 4, 2]
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    for s, d, b in zip(src, dst, before, strict=True):
        want = b.clone()
        want[torch.from_numpy(slots if store else gpu_ids)] = s[torch.from_numpy(gpu_ids if store else slots)]
        assert torch.equal(d, want)


def gpu_side(kind: str, widths, num_blocks: int, gen) -> list[torch.Tensor]:
    """GPU regions as engines hand them over: separate tensors, regions cut region-major from one storage
    (``KVLayout.from_tensors``: ``[n, num_blocks, w]``), side by side in each row, or two storages."""
    def region_major(ws):
        flat = torch.randint(0, 256, (len(ws) * num_blocks * ws[0],), dtype=torch.uint8, generator=gen)
        return list(flat.view(len(ws), num_blocks, ws[0]).unbind(0))

    if kind == "separate" or len(set(widths)) > 1 and kind == "region_major":
        return [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]
    if kind == "region_major":
        return region_major(widths)
    if kind == "in_rows":
        rows = torch.randint(0, 256, (num_blocks, sum(widths) + 8), dtype=torch.uint8, generator=gen)  # + a gap
        return list(torch.split(rows[:, : sum(widths)], list(widths), dim=1))
    half = len(widths) // 2  # two storages (one, for a lone region)
    if half == 0:
        return region_major(widths)
    return gpu_side("region_major", widths[:half], num_blocks, gen) + gpu_side("in_rows", widths[half:], num_blocks, gen)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.sampled_from([8, 40, 64]), st.sampled_from(["region_major", "in_rows", "two"]),
       st.integers(1, 12), st.data())  # fmt: skip
def test_gather_per_storage_matches_naive_copy(n_regions, width, kind, num_blocks, data):
    widths = [width] * n_regions
    gen = torch.Generator().manual_seed(n_regions * 31 + num_blocks)
    gpu = gpu_side(kind, widths, num_blocks, gen)
    order = data.draw(st.sampled_from([list(range(n_regions)), list(range(n_regions))[::-1],
                                       data.draw(st.permutations(range(n_regions)))]))  # fmt: skip
    num_slots = data.draw(st.integers(1, 12))
    store = data.draw(st.booleans())
    src_len, dst_len = (num_blocks, num_slots) if store else (num_slots, num_blocks)
    n = data.draw(st.integers(0, dst_len))
    src_ids = _drawn_ids(data.draw, src_len, n, unique=False)
    dst_ids = _drawn_ids(data.draw, dst_len, n, unique=True)
    cpu, _ = cpu_side("slab", widths, num_slots, order, gen)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    expected = [d.clone() for d in dst]
    for s, d in zip(src, expected, strict=True):
        for i, j in zip(src_ids, dst_ids, strict=True):
            d[j] = s[i]
    staging = Staging(torch.device("cpu"), data.draw(st.sampled_from([width, 3 * width * n_regions, 1 << 20])))
    src_arr, dst_arr = np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)
    slabs = host_slabs(cpu)
    if store:
        enqueue_store(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy)
    else:
        enqueue_load(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy)
    for r, (got, want) in enumerate(zip(dst, expected, strict=True)):
        assert torch.equal(got, want), f"region {r} differs from the per-row copy"


class IndexKernels(TorchDispatchMode):
    """Counts the device index kernels (gathers and scatters) a batch queues."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "index_select" in str(func) or "index_copy" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("store", [True, False])
def test_one_index_kernel_per_storage_per_chunk(store):
    # Two layers, K and V each, cut region-major from one storage per layer (as KVLayout.from_tensors
    # does): one gather per layer, not one per region.
    gen = torch.Generator().manual_seed(9)
    num_blocks, width = 16, 64
    gpu = gpu_side("region_major", [width] * 2, num_blocks, gen) + gpu_side("region_major", [width] * 2, num_blocks, gen)
    cpu, _ = cpu_side("slab", [width] * 4, 8, [0, 1, 2, 3], gen)
    assert [g.regions for g in gpu_groups(gpu, host_slabs(cpu)[0])] == [(0, 1), (2, 3)]
    gpu_ids, slots = np.array([9, 2, 14, 5], dtype=np.int64), np.array([0, 1, 2, 3], dtype=np.int64)
    staging = Staging(torch.device("cpu"), 2 * 4 * width)  # two rows per chunk: two chunks
    before = [t.clone() for t in (cpu if store else gpu)]
    with IndexKernels() as kernels:
        if store:
            enqueue_store(gpu, host_slabs(cpu), gpu_ids, slots, staging, torch.from_numpy)
        else:
            enqueue_load(gpu, host_slabs(cpu), slots, gpu_ids, staging, torch.from_numpy)
    assert kernels.count == 2 * 2, f"{kernels.count} index kernels for 2 storages x 2 chunks"
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    for s, d, b in zip(src, dst, before, strict=True):
        want = b.clone()
        want[torch.from_numpy(slots if store else gpu_ids)] = s[torch.from_numpy(gpu_ids if store else slots)]
        assert torch.equal(d, want)


def test_host_slabs_finds_the_cpu_tier_slab():
    layout = KVLayout.from_block_bytes([4096, 300, 64], num_blocks=4)
    tier = CpuSlabs(layout, 6, pin="off")
    (found,) = host_slabs(tier.regions)
    assert found.rows.data_ptr() == tier.slab.data_ptr() and found.rows.shape == tier.slab.shape
    assert found.rows.is_contiguous() and found.offsets == tuple(tier.offsets) == (0, 4096, 4396)
    # Regions handed over in another order keep their own offsets.
    (shuffled,) = host_slabs([tier.regions[2], tier.regions[0], tier.regions[1]])
    assert shuffled.offsets == (4396, 0, 4096) and shuffled.rows.data_ptr() == tier.slab.data_ptr()
    # Separate contiguous tensors: one slab per region.
    separate = [torch.zeros((6, w), dtype=torch.uint8) for w in (16, 300)]
    assert [(s.regions, s.offsets) for s in host_slabs(separate)] == [((0,), (0,)), ((1,), (0,))]


@pytest.mark.parametrize(
    "columns",
    [[(0, 16), (24, 8)], [(0, 16), (8, 16)], [(0, 16)]],
    ids=["gap", "overlap", "one-strided-region"],
)
def test_strided_cpu_regions_that_do_not_tile_a_slab_are_refused(columns):
    slab = torch.zeros((5, 32), dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"cpu region 0 has a row stride of 32 bytes for 16-byte rows"):
        host_slabs([slab[:, a : a + w] for a, w in columns])
