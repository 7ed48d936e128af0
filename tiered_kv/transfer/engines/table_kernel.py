"""The one-launch row kernel of the table path (issue 38), in Triton; absent when triton is not installed.

One program per (row of the call, region): it reads the region's base address, row stride, width and
column from the table (built once, transfer/engines/table.py) and copies that region's row of the call's block
between the GPU and a host-side row (a staging buffer's row, or a pinned slab's row read or written in
place through unified addressing). Every address is an int64 turned into a pointer in the kernel, as
vLLM's swap_blocks_triton does: regions live in unrelated allocations, so no tensor argument could
name them all. Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (the CPU tests).
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import TransferError

# Imported on first need (``available``): importing triton costs about 0.1 s, which a CPU-only user of
# tiered_kv should not pay. CUDA builds of torch ship triton; the CPU venv has it from the `kernel` extra.
triton: Any = None
tl: Any = None
_IMPORT_FAILED = False

_ELEM_BITS = {8: 64, 4: 32, 2: 16, 1: 8}
_KERNELS: dict[bool, Any] = {}


def available() -> bool:
    """Whether triton imports here (imported now, once)."""
    global triton, tl, _IMPORT_FAILED
    if triton is None and not _IMPORT_FAILED:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError:
            _IMPORT_FAILED = True
        else:
            triton, tl = _triton, _tl
    return triton is not None


def interpreting() -> bool:
    """Triton runs kernels in its interpreter, on CPU tensors too (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _rows_kernel(
    ids, host_rows, region_addr, region_stride, widths, cols, host_addr, host_row_bytes,
    LOAD: tl.constexpr, INDEXED: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    r = tl.program_id(1)
    blk = tl.load(ids + row)
    if INDEXED:  # host rows are the call's slots (in place); else the staging chunk's rows in order
        hrow = tl.load(host_rows + row)
    else:
        hrow = row.to(tl.int64)
    gpu_byte = tl.load(region_addr + r) + blk * tl.load(region_stride + r)
    host_byte = host_addr + hrow * host_row_bytes + tl.load(cols + r)
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


def launch(table: Any, ids: Any, host_rows: Any, host_addr: int, host_row_bytes: int, n: int, *,
           load: bool, indexed: bool) -> None:  # fmt: skip
    """Copy ``n`` rows of every region of ``table`` (transfer/engines/table.RegionTable) in one launch.

    ``ids``: the rows' GPU block ids (device int64); ``host_rows``: their host rows when ``indexed``
    (else row i of the call is host row i: a staging chunk); ``host_addr``/``host_row_bytes``: the host
    buffer's first byte and row stride.
    """
    # Decorated on first use, per mode: triton.jit picks the interpreter from TRITON_INTERPRET at
    # decoration time, and a test process may set it after importing tiered_kv.
    if not available():
        raise TransferError("the table path's kernel needs triton, which does not import here "
                            "(pip install -e '.[kernel]', or copy path 'groups')")
    mode = interpreting()
    kernel = _KERNELS.get(mode)
    if kernel is None:
        kernel = _KERNELS[mode] = triton.jit(_rows_kernel)
    kernel[(n, table.n_regions)](
        ids, host_rows if indexed else ids, table.addr, table.stride, table.widths, table.cols,
        host_addr, host_row_bytes,
        LOAD=load, INDEXED=indexed, BITS=_ELEM_BITS[table.elem], BLOCK=table.block,
    )  # fmt: skip
