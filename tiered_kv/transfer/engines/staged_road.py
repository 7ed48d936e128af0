"""The staged road's buffers and native set-up (issue 46 item 3), for a DirectCopyEngine whose rows are too
small to go to the link one descriptor each.

Per direction: a ring of ``ring_chunks`` staging buffers of ``chunk_bytes`` on the GPU, and an ids area of
``max_inflight`` slots of max(blocks, slots) int64 rows, pinned on the host and mirrored on the device (a call
copies its ids over once). The native copier (native/staged_issue.hpp) then launches the capped kernel
(ring_kernel.py) per chunk and issues one batch of slab descriptors per chunk.

The fake driver runs the kernel as its host reference. On a real GPU the compiled Triton function's handle and
its launch parameters are still to be pinned per Triton version and measured: until then it is refused here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...core import core
from ...errors import TransferError
from .ring_kernel import CHUNK_BYTES, DIRECT_MIN_ROW, PROGRAMS, RING_CHUNKS, ring_table, staged_path
from .staged import host_slabs


def attach_staged(
    copier: Any, gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor], *, fake: bool, max_inflight: int,
    chunk_bytes: int = CHUNK_BYTES, ring_chunks: int = RING_CHUNKS, programs: int = PROGRAMS,
    min_row: int = DIRECT_MIN_ROW,
) -> tuple[str, list[torch.Tensor]]:  # fmt: skip
    """Set the copier on the staged road; (its copy path name, the buffers the engine must keep alive)."""
    if not fake:
        raise TransferError("the staged road's kernel launch is not yet pinned to a Triton version on a GPU: "
                            "it runs on the fake driver only (copy path 'table' stages on a GPU today)")  # fmt: skip
    table = ring_table(gpu, cpu)
    slab = host_slabs(cpu)[0]
    elem = table.bits // 8
    rows = max(1, chunk_bytes // table.row_bytes)
    dev = gpu[0].device
    rings = [[torch.empty(rows * table.row_bytes, dtype=torch.uint8, device=dev) for _ in range(ring_chunks)]
             for _ in range(2)]  # fmt: skip
    max_rows = max(int(gpu[0].shape[0]), int(cpu[0].shape[0]))
    ids_dev = [torch.empty(max_inflight * max_rows, dtype=torch.int64, device=dev) for _ in range(2)]
    ids_host = [torch.empty(max_inflight * max_rows, dtype=torch.int64) for _ in range(2)]
    host_stride = int(slab.rows.stride(0)) if slab.rows.shape[0] > 1 else slab.width
    fake_cuda = core.fake_cuda
    copier.set_staged(
        (fake_cuda.ring_function(False, elem), fake_cuda.ring_function(True, elem)), 128, 0, programs, 0,
        (table.gpu_addr.data_ptr(), table.gpu_stride.data_ptr(), table.widths.data_ptr(), table.cols.data_ptr()),
        elem, table.row_bytes, table.n_regions, slab.rows.data_ptr(), host_stride, rows, max_rows,
        ([b.data_ptr() for b in rings[0]], [b.data_ptr() for b in rings[1]]),
        (ids_host[0].data_ptr(), ids_host[1].data_ptr()), (ids_dev[0].data_ptr(), ids_dev[1].data_ptr()),
    )  # fmt: skip
    name = staged_path(min_row, ring_chunks=ring_chunks, chunk_bytes=chunk_bytes, programs=programs)
    keep = [table.gpu_addr, table.gpu_stride, table.widths, table.cols, *rings[0], *rings[1], *ids_dev, *ids_host]
    return name, keep
