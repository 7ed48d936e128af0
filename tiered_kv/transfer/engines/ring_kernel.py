"""The staged road's capped, persistent gather/scatter kernel (issue 46 item 3), in Triton.

Rows too small to go to the link as a descriptor each (below ``DIRECT_MIN_ROW``, 1 MiB: Llama-8B's 32 KiB K or
V rows) are gathered on the GPU into a staging chunk in slab-row order, and the chunk goes to the slab as one
descriptor per run of slots (native/ring_plan.hpp plans both; loads scatter the reverse way). The grid is
capped at ``PROGRAMS`` (16) programs, each looping over (row, region) work items: the copy holds 16 SMs for
the ~10 us of an 8 MiB chunk instead of a program per (row, region) on every SM, and 16 SMs still move
>= 1 TB/s through HBM, 20x what PCIe needs (shared/gpu/copy-path-design.md 2.1.2). Staging is a ring of
``RING_CHUNKS`` x ``CHUNK_BYTES`` per direction (4 x 8 MiB: a small pipeline fill, and it may stay in L2).

Which road a layout takes is decided once (``ring_road``) and named in the copy path string: rows of at
least ``min_row`` bytes, or one region per block id (a packed, GPU-contiguous block), go direct; else staged.

Every address is an int64 turned into a pointer in the kernel (regions live in unrelated allocations, as in
table_kernel.py). Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the CPU tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import LayoutError, TransferError
from . import table_kernel
from .staged import host_slabs

# The threshold between the roads: at ~0.75 us of copy engine per descriptor, 1 MiB rows reach ~0.96 of the
# link on their own, 256 KiB rows ~0.84 (shared/gpu/copy-path-design.md 2.2); smaller rows are staged.
DIRECT_MIN_ROW = 1 << 20
PROGRAMS = 16
RING_CHUNKS = 4
CHUNK_BYTES = 8 << 20
_BLOCK = 1024  # elements per inner step of a row
_KERNELS: dict[bool, Any] = {}


def _ring_kernel(
    ids, gpu_addr, gpu_stride, widths, cols, chunk_addr, chunk_row, n_rows, n_regions,
    LOAD: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
):  # fmt: skip
    # Strides, widths, columns and the chunk row are in elements of BITS; addresses in bytes.
    pid = tl.program_id(0)
    for item in range(pid, n_rows * n_regions, PROGRAMS):
        row = item // n_regions
        r = item % n_regions
        blk = tl.load(ids + row)
        gpu_byte = tl.load(gpu_addr + r) + blk * tl.load(gpu_stride + r) * (BITS // 8)
        host_byte = chunk_addr + (row * chunk_row + tl.load(cols + r)) * (BITS // 8)
        if BITS == 64:  # constexpr branches: only the taken one is compiled
            gpu = gpu_byte.to(tl.pointer_type(tl.int64))
            host = host_byte.to(tl.pointer_type(tl.int64))
        elif BITS == 32:
            gpu = gpu_byte.to(tl.pointer_type(tl.int32))
            host = host_byte.to(tl.pointer_type(tl.int32))
        elif BITS == 16:
            gpu = gpu_byte.to(tl.pointer_type(tl.int16))
            host = host_byte.to(tl.pointer_type(tl.int16))
        else:
            gpu = gpu_byte.to(tl.pointer_type(tl.int8))
            host = host_byte.to(tl.pointer_type(tl.int8))
        width = tl.load(widths + r)
        for start in range(0, width, BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < width
            if LOAD:
                tl.store(gpu + o, tl.load(host + o, mask=m), mask=m)
            else:
                tl.store(host + o, tl.load(gpu + o, mask=m), mask=m)


tl: Any = None  # bound on first launch (table_kernel imports triton lazily)


@dataclass(frozen=True)
class RingTable:
    """The kernel's region table (on the GPU regions' device), built once per engine."""

    gpu_addr: torch.Tensor  # int64 bytes
    gpu_stride: torch.Tensor  # elements
    widths: torch.Tensor  # elements
    cols: torch.Tensor  # elements, within a chunk row
    row_bytes: int  # a chunk row: one block's bytes laid out as the slab row
    bits: int

    @property
    def n_regions(self) -> int:
        return int(self.widths.shape[0])


def ring_table(gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor]) -> RingTable:
    """The table for these regions; the CPU regions must tile ONE slab (a chunk row is a slab row)."""
    slabs = host_slabs(cpu)
    if len(slabs) != 1:
        raise LayoutError(f"the staged road needs the cpu regions in one block-major slab, got {len(slabs)} slabs")
    slab = slabs[0]
    cols = dict(zip(slab.regions, slab.offsets, strict=True))
    strides = [int(g.stride(0)) if g.shape[0] > 1 else int(g.shape[1]) for g in gpu]
    numbers = [slab.width, *strides, *(int(g.shape[1]) for g in gpu), *cols.values(), *(g.data_ptr() for g in gpu)]
    elem = next(e for e in (8, 4, 2, 1) if all(x % e == 0 for x in numbers))
    dev = gpu[0].device
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
    return RingTable(
        as_t([g.data_ptr() for g in gpu]), as_t([s // elem for s in strides]),
        as_t([int(g.shape[1]) // elem for g in gpu]), as_t([cols[r] // elem for r in range(len(gpu))]),
        slab.width, elem * 8,
    )  # fmt: skip


def launch(table: RingTable, ids: torch.Tensor, chunk_addr: int, n_rows: int, *, load: bool,
           programs: int = PROGRAMS) -> None:  # fmt: skip
    """Gather (store) or scatter (load) ``n_rows`` blocks ``ids`` (device int64) to/from the chunk at
    ``chunk_addr`` (row i of the chunk is block ids[i]) on at most ``programs`` programs."""
    global tl
    if not table_kernel.available():
        raise TransferError("the staged road's kernel needs triton, which does not import here (pip install -e '.[kernel]')")
    if chunk_addr % (table.bits // 8):
        raise TransferError(f"staging chunk at {chunk_addr:#x} is not aligned to {table.bits // 8} bytes")
    tl = table_kernel.tl
    mode = table_kernel.interpreting()  # triton.jit reads TRITON_INTERPRET when it decorates
    kernel = _KERNELS.get(mode)
    if kernel is None:
        kernel = _KERNELS[mode] = table_kernel.triton.jit(_ring_kernel)
    if n_rows <= 0:
        return
    grid = (max(1, min(programs, n_rows * table.n_regions)),)
    kernel[grid](
        ids, table.gpu_addr, table.gpu_stride, table.widths, table.cols, chunk_addr,
        table.row_bytes // (table.bits // 8), n_rows, table.n_regions,
        LOAD=load, BITS=table.bits, BLOCK=_BLOCK, PROGRAMS=grid[0],
    )  # fmt: skip


def ring_road(gpu: Sequence[torch.Tensor], min_row: int = DIRECT_MIN_ROW, *, ring_chunks: int = RING_CHUNKS,
              chunk_bytes: int = CHUNK_BYTES, programs: int = PROGRAMS) -> str:  # fmt: skip
    """The road a layout takes, named with its threshold: ``direct`` (one region per block id: the block is
    contiguous on the GPU; or every row >= ``min_row``), else ``staged``."""
    if len(gpu) == 1 or all(int(g.shape[1]) >= min_row for g in gpu):
        return f"direct(min_row={min_row})"
    return staged_path(min_row, ring_chunks=ring_chunks, chunk_bytes=chunk_bytes, programs=programs)


def staged_path(min_row: int = DIRECT_MIN_ROW, *, ring_chunks: int = RING_CHUNKS, chunk_bytes: int = CHUNK_BYTES,
                programs: int = PROGRAMS) -> str:  # fmt: skip
    """The staged road's copy path name, with its threshold, ring and grid."""
    size = f"{chunk_bytes >> 20}MiB" if chunk_bytes % (1 << 20) == 0 else f"{chunk_bytes}B"
    return f"staged(min_row={min_row},ring={ring_chunks}x{size},programs={programs})"
