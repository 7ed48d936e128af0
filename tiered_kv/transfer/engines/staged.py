"""The copies themselves, device-agnostic: host row buffers, GPU region groups, staging, and the enqueue plans.

A store gathers the batch's GPU rows into a block-major staging buffer (one
kernel per *group* of regions per chunk), then issues one DMA per run of
consecutive CPU slots; a load does the reverse. A group is every region of one
GPU storage that one strided view covers: the regions ``KVLayout.from_tensors``
cuts from one storage (``[n_regions, num_blocks, block_bytes]``, region-major)
are one ``[num_blocks, n_regions, block_bytes]`` view, so a layer's K and V (or
all layers of a shared allocation) gather in one kernel instead of one each.
Nothing here names a device: CPU tests drive the same code the CUDA engine runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import LayoutError

# Widest element type first: the device index kernels move one element per
# thread, so int64 rows move 8x fewer elements than uint8 rows.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16)


@dataclass(frozen=True)
class HostSlab:
    """Contiguous host rows ``[num_slots, width]``; region ``regions[i]`` sits at columns ``offsets[i]..``."""

    rows: torch.Tensor
    regions: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def width(self) -> int:
        return int(self.rows.shape[1])


def host_slabs(cpu_regions: Sequence[torch.Tensor]) -> list[HostSlab]:
    """The CPU regions as contiguous row buffers the DMAs can address.

    One block-major slab when the regions are column views that tile it exactly
    (one storage, row stride = the sum of the widths, no gap, no overlap); else
    one slab per region, each of which must have contiguous rows.
    """
    slab = _block_major(cpu_regions)
    if slab is not None:
        return [slab]
    out = []
    for r, c in enumerate(cpu_regions):
        if c.shape[0] > 1 and c.shape[1] > 0 and c.stride(0) != c.shape[1]:
            raise LayoutError(
                f"cpu region {r} has a row stride of {c.stride(0)} bytes for {int(c.shape[1])}-byte rows, and the "
                "cpu regions do not tile one block-major slab: a copy to strided host memory is not one DMA"
            )
        out.append(HostSlab(c, (r,), (0,)))
    return out


def _block_major(cpu: Sequence[torch.Tensor]) -> HostSlab | None:
    if len(cpu) < 2:
        return None  # a lone region is its own slab (or strided and refused)
    rows = int(cpu[0].shape[0])
    widths = [int(c.shape[1]) for c in cpu]
    width = sum(widths)
    storage = cpu[0].untyped_storage().data_ptr()
    for c in cpu:
        if c.untyped_storage().data_ptr() != storage or c.stride(1) != 1:
            return None
        if rows > 1 and c.stride(0) != width:
            return None
    starts = [c.storage_offset() for c in cpu]  # uint8: elements are bytes
    base = min(starts)
    pos = base
    for r in sorted(range(len(cpu)), key=lambda r: (starts[r], widths[r])):
        if starts[r] != pos:
            return None  # a gap (bytes of someone else's) or an overlap
        pos += widths[r]
    # Within the storage: the region ending at column `width` reaches base + rows * width.
    slab = cpu[0].as_strided((rows, width), (width, 1), base)
    return HostSlab(slab, tuple(range(len(cpu))), tuple(s - base for s in starts))


@dataclass(frozen=True)
class GpuGroup:
    """GPU regions ``regions`` at slab columns ``offset ..`` as one view: ``[num_blocks, k, w]``, or the
    lone region's ``[num_blocks, w]``. One index kernel per chunk moves all of them."""

    view: torch.Tensor
    offset: int
    regions: tuple[int, ...]

    def cols(self, stage: torch.Tensor) -> torch.Tensor:
        """The group's columns of a staging chunk, shaped like the view's rows."""
        width = int(np.prod(self.view.shape[1:]))
        cols = stage[:, self.offset : self.offset + width]
        return cols if self.view.dim() == 2 else cols.unflatten(1, tuple(self.view.shape[1:]))


def gpu_groups(gpu: Sequence[torch.Tensor], slab: HostSlab) -> list[GpuGroup]:
    """The slab's regions grouped into views of their GPU storages.

    Regions join a group while they are adjacent in the slab's columns and, on the
    GPU, share the storage, the shape and the row stride, and start a constant
    ``D`` bytes apart with no byte of two (block, region) pairs in common: whole
    regions one after another (``D >= (num_blocks - 1) * stride + width``, how
    ``KVLayout.from_tensors`` cuts a storage) or side by side inside each row.
    """
    members = sorted(zip(slab.offsets, slab.regions, strict=True))
    groups: list[GpuGroup] = []
    run: list[tuple[int, int]] = []
    for off, r in members:
        if run and _joins(gpu, run, off, r):
            run.append((off, r))
            continue
        if run:
            groups.append(_group(gpu, run))
        run = [(off, r)]
    if run:
        groups.append(_group(gpu, run))
    return groups


def _joins(gpu: Sequence[torch.Tensor], run: list[tuple[int, int]], off: int, r: int) -> bool:
    first, last, g = gpu[run[0][1]], gpu[run[-1][1]], gpu[r]
    rows, width = int(first.shape[0]), int(first.shape[1])
    if off != run[-1][0] + width or g.shape != first.shape or width == 0:
        return False
    if g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return False
    if (rows > 1 and g.stride(0) != first.stride(0)) or (width > 1 and g.stride(1) != 1):
        return False
    step = g.storage_offset() - last.storage_offset()
    if len(run) > 1 and step != last.storage_offset() - gpu[run[-2][1]].storage_offset():
        return False
    row = first.stride(0) if rows > 1 else 0
    k = len(run) + 1
    return step >= (rows - 1) * row + width or (step >= width and (k - 1) * step + width <= row)


def _group(gpu: Sequence[torch.Tensor], run: list[tuple[int, int]]) -> GpuGroup:
    regions = tuple(r for _, r in run)
    first = gpu[regions[0]]
    if len(run) == 1:
        return GpuGroup(first, run[0][0], regions)
    rows, width = int(first.shape[0]), int(first.shape[1])
    step = gpu[regions[1]].storage_offset() - first.storage_offset()
    row = first.stride(0) if rows > 1 else width
    view = first.as_strided((rows, len(run), width), (row, step, 1), first.storage_offset())
    return GpuGroup(view, run[0][0], regions)


class Staging:
    """Reusable device buffers, handed out in turn as ``[n, width]`` views of at most ``limit_bytes``.

    ``buffers`` (two by default) alternate chunk by chunk, so one chunk's gather kernel can fill one
    buffer while the previous chunk's DMA drains the other (``Lanes`` orders them when those run on two
    streams; on one stream, or on the CPU, they simply run in order). ``last`` is the index of the buffer
    the latest ``view`` came from. Device-agnostic, so CPU tests drive it.
    """

    def __init__(self, device: torch.device, limit_bytes: int, buffers: int = 2) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self._buffers: list[torch.Tensor | None] = [None] * max(1, buffers)
        self.last = len(self._buffers) - 1

    @property
    def buffer(self) -> torch.Tensor | None:
        """The buffer the latest view came from (None before the first)."""
        return self._buffers[self.last]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer allocated so far (to keep alive while a batch may use them)."""
        return [b for b in self._buffers if b is not None]

    def rows_per_chunk(self, width: int) -> int:
        """Rows of ``width`` bytes per chunk; one chunk exceeds the limit only when one row does."""
        return max(1, self.limit_bytes // max(width, 1))

    def view(self, rows: int, width: int) -> torch.Tensor:
        self.last = (self.last + 1) % len(self._buffers)
        nbytes = rows * width
        buf = self._buffers[self.last]
        if buf is None or buf.numel() < nbytes:
            # Allocated while the kernel stream is current, so the caching allocator ties it (and the
            # memory of any buffer it replaces) to that stream; Lanes.uses() adds the DMA stream.
            # Doubling bounds the regrowths.
            size = max(nbytes, min(self.limit_bytes, 2 * (0 if buf is None else buf.numel())))
            buf = self._buffers[self.last] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(rows, width)

    def release(self) -> None:
        self._buffers = [None] * len(self._buffers)


class Lanes:
    """Where a staged chunk's two halves run: the device kernel (gather, scatter) and the DMA.

    This base runs both on the current stream (and on the CPU), where order is program order and every
    hook is a no-op. ``CudaLanes`` (transfer/engines/cuda.py) puts the DMAs on a stream of their own; before a
    lane touches staging buffer ``b`` it waits for the other lane's last use of ``b``, so with two
    buffers a gather overlaps the previous chunk's DMA and no buffer is overwritten while it is read.
    """

    def kernel(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def dma(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def before(self, lane: str, b: int) -> None:
        """``lane`` ("kernel" or "dma") is about to use staging buffer ``b``."""

    def after(self, lane: str, b: int) -> None:
        """``lane`` has queued all its work on staging buffer ``b``."""

    def uses(self, buffer: torch.Tensor) -> None:
        """The DMA lane reads or writes ``buffer`` (allocated on the kernel lane)."""

    def finish(self) -> None:
        """The kernel stream (where the batch's done event is recorded) waits for the DMA lane."""


ONE_STREAM = Lanes()


Index = Callable[[np.ndarray], torch.Tensor]


def enqueue_store(
    gpu: Sequence[torch.Tensor], slabs: Sequence[HostSlab], gpu_ids: np.ndarray, cpu_slots: np.ndarray,
    staging: Staging, index: Index, dma_rows: int | None = None, groups: Sequence[list[GpuGroup]] | None = None,
    lanes: Lanes = ONE_STREAM,
) -> None:  # fmt: skip
    """Queue GPU rows -> CPU slots: gather into staging (one kernel per GPU group) on the kernel lane, one DMA
    per run of slots (cut at multiples of ``dma_rows``, where the slab's registered chunks end) on the DMA
    lane. ``groups``: ``gpu_groups`` of each slab, computed once by the engine (here when omitted)."""
    plan = _Plan(cpu_slots, gpu_ids, direct_ok=len(slabs[0].regions) == 1, index=index, dma_rows=dma_rows)
    try:
        for k, slab in enumerate(slabs):
            for g0, s0, n in plan.direct:
                slab.rows[s0 : s0 + n].copy_(gpu[slab.regions[0]][g0 : g0 + n], non_blocking=True)
            slab_groups = groups[k] if groups is not None else None
            for stage, ids, spans in plan.staged(slab.width, staging):
                b = staging.last
                if slab_groups is None:
                    slab_groups = gpu_groups(gpu, slab)
                with lanes.kernel():
                    lanes.before("kernel", b)
                    for group in slab_groups:
                        cols = group.cols(stage)
                        if isinstance(ids, int):  # consecutive GPU rows: a strided device copy, no index
                            gw, cw = _widen(group.view[ids : ids + len(stage)], cols)
                            cw.copy_(gw)
                        else:
                            gw, cw = _widen(group.view, cols)
                            torch.index_select(gw, 0, ids, out=cw)
                    lanes.after("kernel", b)
                with lanes.dma():
                    lanes.before("dma", b)
                    lanes.uses(staging.buffer)
                    for o, first, length in spans:
                        slab.rows[first : first + length].copy_(stage[o : o + length], non_blocking=True)
                    lanes.after("dma", b)
    finally:  # also when enqueueing failed part-way: the done event must cover the queued DMAs
        lanes.finish()


def enqueue_load(
    gpu: Sequence[torch.Tensor], slabs: Sequence[HostSlab], cpu_slots: np.ndarray, gpu_ids: np.ndarray,
    staging: Staging, index: Index, dma_rows: int | None = None, groups: Sequence[list[GpuGroup]] | None = None,
    lanes: Lanes = ONE_STREAM,
) -> None:  # fmt: skip
    """Queue CPU slots -> GPU rows: one DMA per run of slots into staging on the DMA lane, then one scatter
    kernel per GPU group on the kernel lane (see enqueue_store)."""
    plan = _Plan(cpu_slots, gpu_ids, direct_ok=len(slabs[0].regions) == 1, index=index, dma_rows=dma_rows)
    try:
        for k, slab in enumerate(slabs):
            for g0, s0, n in plan.direct:
                gpu[slab.regions[0]][g0 : g0 + n].copy_(slab.rows[s0 : s0 + n], non_blocking=True)
            slab_groups = groups[k] if groups is not None else None
            for stage, ids, spans in plan.staged(slab.width, staging):
                b = staging.last
                with lanes.dma():
                    lanes.before("dma", b)
                    lanes.uses(staging.buffer)
                    for o, first, length in spans:
                        stage[o : o + length].copy_(slab.rows[first : first + length], non_blocking=True)
                    lanes.after("dma", b)
                if slab_groups is None:
                    slab_groups = gpu_groups(gpu, slab)
                with lanes.kernel():
                    lanes.before("kernel", b)
                    for group in slab_groups:
                        cols = group.cols(stage)
                        if isinstance(ids, int):
                            cw, gw = _widen(cols, group.view[ids : ids + len(stage)])
                            gw.copy_(cw)
                        else:
                            cw, gw = _widen(cols, group.view)
                            gw.index_copy_(0, ids, cw)
                    lanes.after("kernel", b)
    finally:
        lanes.finish()


class _Plan:
    """A batch's rows sorted by CPU slot, split into direct runs and staged rows.

    A direct run (only for single-region slabs, whose rows are whole blocks) is
    consecutive on both sides: one copy, no staging. Everything else is staged
    in chunks; the GPU index is uploaded once per batch, and only when some
    chunk's GPU rows are not consecutive.
    """

    def __init__(self, slots: np.ndarray, dev: np.ndarray, *, direct_ok: bool, index: Index,
                 dma_rows: int | None = None) -> None:  # fmt: skip
        if len(slots) > 1 and not bool(np.all(slots[1:] > slots[:-1])):
            order = np.argsort(slots, kind="stable")
            slots, dev = slots[order], dev[order]
        bounds = _run_bounds(slots)
        a, b = bounds[:-1], bounds[1:]
        if direct_ok and len(slots):
            cuts = np.flatnonzero(np.diff(dev) != 1) + 1  # where the GPU ids stop being consecutive
            direct = np.searchsorted(cuts, b, "left") == np.searchsorted(cuts, a, "right")
        else:
            direct = np.zeros(len(a), dtype=bool)
        firsts = (dev[a[direct]].tolist(), slots[a[direct]].tolist(), (b - a)[direct].tolist())
        self.direct = _cut_runs(list(zip(*firsts, strict=True)), dma_rows)
        self._dma_rows = dma_rows
        staged = np.repeat(~direct, b - a)
        self.slots, self.dev = slots[staged], dev[staged]
        self._index = index
        self._idx: torch.Tensor | None = None

    def staged(self, width: int, staging: Staging) -> Iterator[tuple[torch.Tensor, int | torch.Tensor, list]]:
        """Yield (stage ``[n, width]``, GPU rows as a first id or an index, slot spans) per chunk."""
        total = len(self.slots)
        per = staging.rows_per_chunk(width)
        for a in range(0, total, per):
            b = min(total, a + per)
            dev = self.dev[a:b]
            if int(dev[-1]) - int(dev[0]) == b - a - 1 and bool(np.all(np.diff(dev) == 1)):
                ids: int | torch.Tensor = int(dev[0])
            else:
                if self._idx is None:
                    self._idx = self._index(self.dev)
                ids = self._idx[a:b]
            yield staging.view(b - a, width), ids, _spans(self.slots[a:b], self._dma_rows)


def _run_bounds(ids: np.ndarray) -> np.ndarray:
    """``[0, ..., n]``: boundaries of the runs of consecutive ids."""
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    return np.concatenate(([0], cuts, [len(ids)])).astype(np.int64) if len(ids) else np.zeros(1, np.int64)


def _spans(slots: np.ndarray, dma_rows: int | None = None) -> list[tuple[int, int, int]]:
    """``(offset, first slot, length)`` for each run of consecutive slots, cut where a registered chunk ends."""
    bounds = _run_bounds(slots)
    starts = bounds[:-1]
    spans = list(zip(starts.tolist(), slots[starts].tolist(), np.diff(bounds).tolist(), strict=True))
    return _cut_runs(spans, dma_rows)


def _cut_runs(runs: list[tuple[int, int, int]], every: int | None) -> list[tuple[int, int, int]]:
    """Runs ``(other side's first, first slot, length)`` cut where the slots cross a multiple of ``every``.

    The pinned slab is registered in chunks of ``every`` rows, and one DMA stays
    inside one registration.
    """
    if not every or all(slot // every == (slot + n - 1) // every for _, slot, n in runs):
        return runs
    out = []
    for a, b, length in runs:
        done = 0
        while done < length:
            piece = min(length - done, every - (b + done) % every)
            out.append((a + done, b + done, piece))
            done += piece
    return out


def _widen(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bytes viewed as the widest integer type both tensors allow (offsets, strides, widths)."""
    for dtype in _WIDE_DTYPES:
        try:
            return src.view(dtype), dst.view(dtype)
        except RuntimeError:
            continue
    return src, dst
