"""The table path (issue 38): every region of a call's blocks in one kernel launch per chunk.

The per-group path (staged.py) launches one index kernel per group of regions per chunk: at 64
regions that was 128 launches and about 6 ms of host time per call on an H200, while the DMAs
themselves ran at the link's speed. Here a ``RegionTable`` (per host slab: each region's base address,
row stride, width and column in the slab's row) is built once, when the engine is built; a call
uploads only its block ids (and slots), from a preallocated ring into a preallocated device buffer,
and launches one kernel (transfer/engines/table_kernel.py) per chunk, whatever the region count.

Two modes, chosen once when the engine starts (``CUDAStreamEngine.copy_path``):
- ``table``: the kernel gathers into staging, then one DMA per run of consecutive slots drains it (the
  reverse for loads); chunks alternate two staging buffers on two streams (``Lanes``), so chunk k+1's
  kernel overlaps chunk k's DMA;
- ``table-direct``: the kernel reads or writes the pinned slab's rows in place (unified addressing): one
  launch per call, no staging and no DMA calls.
Device-agnostic: with ``TRITON_INTERPRET=1`` the CPU tests drive the same code on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import LayoutError
from . import table_kernel
from .staged import ONE_STREAM, HostSlab, Lanes, Staging, _spans

_ELEMS = (8, 4, 2, 1)  # bytes per kernel element, widest first: fewer, wider loads and stores


@dataclass(frozen=True)
class RegionTable:
    """One host slab's regions as the kernel sees them; device int64 tensors, built once."""

    addr: torch.Tensor  # byte address of region r's row 0 on the GPU
    stride: torch.Tensor  # region r's GPU row stride, bytes
    widths: torch.Tensor  # region r's row width, in elements of ``elem`` bytes
    cols: torch.Tensor  # region r's first byte in the slab's row
    elem: int  # bytes per element: the widest that divides every address, stride, width and column
    block: int  # elements per inner step of the kernel (a power of two)
    n_regions: int
    row_bytes: int  # the slab's row (a whole block's bytes for a block-major slab)


def build_table(gpu: Sequence[torch.Tensor], slab: HostSlab, device: torch.device) -> RegionTable:
    """The table of ``slab``'s regions (``gpu[r]`` for ``r`` in ``slab.regions``): LayoutError when a GPU
    region's rows are not dense (the kernel reads ``width`` consecutive bytes per row)."""
    addr, stride, width, cols = [], [], [], []
    for r, col in zip(slab.regions, slab.offsets, strict=True):
        g = gpu[r]
        if g.shape[1] > 1 and g.stride(1) != 1:
            raise LayoutError(f"gpu region {r}: bytes within a row are not adjacent (strides {list(g.stride())})")
        addr.append(g.data_ptr())
        stride.append(g.stride(0) if g.shape[0] > 1 else 0)
        width.append(int(g.shape[1]))
        cols.append(col)
    every = np.array(addr + stride + width + cols + [slab.width, slab.rows.stride(0)], dtype=np.int64)
    elem = next(e for e in _ELEMS if not (every % e).any())
    widest = max(width) // elem
    block = min(1024, 1 << max(0, (widest - 1).bit_length()))
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731 - four at once
    return RegionTable(as_dev(addr), as_dev(stride), as_dev([w // elem for w in width]), as_dev(cols), elem, block,
                       len(addr), slab.width)  # fmt: skip


class DeviceIds:
    """Per-call ids on the device without a per-call allocation: a preallocated device buffer that
    mirrors the pinned ``IndexRing`` stretch by stretch (the same offsets, so a stretch the ring still
    holds for an unfinished batch is never overwritten on the device either)."""

    def __init__(self, ring, device: torch.device) -> None:
        self.ring = ring
        self.buf = torch.empty(ring.capacity, dtype=torch.int64, device=device)
        self.device = device

    def upload(self, ids: np.ndarray, keep: list) -> torch.Tensor:
        host = self.ring.take(ids)
        if host is None:  # the ring is full (or the call is huge): one-off buffers, as the group path does
            host = torch.from_numpy(np.ascontiguousarray(ids)).pin_memory() if self.device.type == "cuda" \
                else torch.from_numpy(np.ascontiguousarray(ids))  # fmt: skip
            dev = host.to(self.device, non_blocking=True)
            keep += (host, dev)
            return dev
        start = host.storage_offset()
        dev = self.buf[start : start + len(ids)]
        dev.copy_(host, non_blocking=True)
        return dev


Launch = Callable[..., None]


def enqueue_table(
    direction_load: bool, tables: Sequence[RegionTable], slabs: Sequence[HostSlab], gpu_ids: np.ndarray,
    cpu_slots: np.ndarray, ids: DeviceIds, keep: list, *, staging: Staging | None, dma_rows: int | None = None,
    lanes: Lanes = ONE_STREAM, launch: Launch | None = None,
) -> None:  # fmt: skip
    """Queue one call on the table path: ``staging`` None means in place (``table-direct``).

    The ids are sorted by slot (runs of slots become single DMAs) and uploaded once, GPU ids and slots
    together; then, per slab, one launch per chunk (or one per call in place). ``launch``: the kernel
    (table_kernel.launch; a test may count launches with its own).
    """
    launch = launch or table_kernel.launch
    n = len(cpu_slots)
    if n > 1 and not bool(np.all(cpu_slots[1:] > cpu_slots[:-1])):
        order = np.argsort(cpu_slots, kind="stable")
        cpu_slots, gpu_ids = cpu_slots[order], gpu_ids[order]
    both = np.concatenate((gpu_ids, cpu_slots)) if staging is None else gpu_ids
    try:
        if n == 0:  # nothing to launch (a grid with no rows)
            return
        with lanes.kernel():
            dev = ids.upload(both, keep)
        dev_ids = dev[:n]
        for table, slab in zip(tables, slabs, strict=True):
            if staging is None:
                with lanes.kernel():
                    launch(table, dev_ids, dev[n:], slab.rows.data_ptr(), slab.rows.stride(0), n,
                           load=direction_load, indexed=True)  # fmt: skip
                continue
            per = staging.rows_per_chunk(slab.width)
            for a in range(0, n, per):
                b = min(n, a + per)
                stage = staging.view(b - a, slab.width)
                k = staging.last
                spans = _spans(cpu_slots[a:b], dma_rows)
                if direction_load:
                    _dma(lanes, k, staging, spans, lambda o, f, m, st=stage, s=slab: st[o : o + m].copy_(
                        s.rows[f : f + m], non_blocking=True))  # fmt: skip
                with lanes.kernel():
                    lanes.before("kernel", k)
                    launch(table, dev_ids[a:b], dev_ids[a:b], stage.data_ptr(), slab.width, b - a,
                           load=direction_load, indexed=False)  # fmt: skip
                    lanes.after("kernel", k)
                if not direction_load:
                    _dma(lanes, k, staging, spans, lambda o, f, m, st=stage, s=slab: s.rows[f : f + m].copy_(
                        st[o : o + m], non_blocking=True))  # fmt: skip
    finally:  # also when enqueueing failed part-way: the done event must cover the queued DMAs
        lanes.finish()


def _dma(lanes: Lanes, k: int, staging: Staging, spans: list, copy: Callable[[int, int, int], object]) -> None:
    with lanes.dma():
        lanes.before("dma", k)
        lanes.uses(staging.buffer)
        for o, first, length in spans:
            copy(o, first, length)
        lanes.after("dma", k)


COPY_PATHS = ("table", "table-direct", "groups")
PATH_ENV = "TIERED_KV_COPY_PATH"


def choose_path(requested: str, device: torch.device) -> str:
    """The copy path, chosen once when an engine starts: ``requested`` ("auto" or one of COPY_PATHS; the
    ``TIERED_KV_COPY_PATH`` environment variable replaces "auto", for the bench and gpu-check). "auto" is
    ``table`` where triton is importable and the device is CUDA (or triton interprets), else ``groups``."""
    import os

    from tiered_kv.errors import ConfigError

    if requested == "auto":
        requested = os.environ.get(PATH_ENV, "") or "auto"
    if requested not in ("auto", *COPY_PATHS):
        raise ConfigError(f"copy path must be auto or one of {', '.join(COPY_PATHS)} (argument copy_path or "
                          f"${PATH_ENV}); got {requested!r}")  # fmt: skip
    runs = (device.type == "cuda" or table_kernel.interpreting()) and table_kernel.available()
    if requested == "auto":
        return "table" if runs else "groups"
    if requested != "groups" and not runs:
        raise ConfigError(f"copy path {requested!r} needs triton (a CUDA build of torch ships it) on {device}; "
                          f"it is not importable here: use groups or auto")  # fmt: skip
    return requested
