"""CUDAStreamEngine: GPU <-> pinned CPU copies on two streams of its own (store, load).

Ordering against the model (the part that silently garbles outputs when wrong,
vLLM #45704): the copy stream waits on the caller's compute event before
touching any block. ``submit_*(..., compute=)`` takes that event (recorded by
the caller on its compute stream), or the compute stream itself (an event is
recorded on it at submit time); without one, an event is recorded on the
current stream of the thread that submits, which is the caller's compute
stream only when the model runs on that thread's current stream. (The current
stream is per thread: on an event-loop thread it is usually the default
stream, and torch's pool streams do not wait on the default stream.) A store
therefore reads what the compute stream wrote, and a load never overwrites a
block the compute stream may still be reading.

Host side: a copy between the GPU and a *strided* host view is not one DMA
(torch stages it through a pageable temporary and may synchronise the calling
thread), so every host copy here is between contiguous buffers. The CPU tier
is one block-major slab ``[num_slots, bytes_per_block]``: a run of consecutive
slots is one contiguous pinned buffer holding all regions of those blocks.
A store gathers each region on the device into a block-major staging buffer
(``index_select`` into its columns), then issues one D2H DMA per run of
consecutive slots; a load does one H2D DMA per run into staging, then scatters
each region's columns on the device. Every staged byte makes one extra pass
through HBM (~3 TB/s, a few percent of the PCIe time) and the engine holds up
to ``staging_bytes`` of GPU memory per direction. CPU regions that are separate
contiguous tensors are handled one region at a time the same way, and runs
consecutive on both sides then skip the staging.

Completion: each batch records a (blocking-sync) event on its stream; the
EventBridge waiter thread for that direction synchronises it and resolves the
future on the loop. ``handle.event`` lets a compute stream wait on a load
directly (``torch.cuda.current_stream().wait_event(handle.event)``).
The enqueue functions are device-agnostic, so CPU tests drive the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiered_kv.errors import ConfigError, LayoutError, TransferError
from tiered_kv.transfer.base import Compute, CopyEngine, CopyHandle, Direction
from tiered_kv.transfer.bridge import EventBridge

DEFAULT_STAGING_BYTES = 64 * 1024 * 1024

# Widest element type first: the device index kernels move one element per
# thread, so int64 rows move 8x fewer elements than uint8 rows.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16)


class CUDAStreamEngine(CopyEngine):
    """Copies on two CUDA streams of its own (store, load); needs pinned CPU regions.

    The streams have the default priority: CUDA's priorities only go up from the
    default (``priority_range()`` is ``(0, -N)``: 0 is already the least), so a
    copy stream cannot rank below a default compute stream, only beside it.
    ``dma_rows``: the pinned slab's registered chunks, in rows (``CpuSlabs.dma_rows``):
    no DMA crosses a multiple of it.
    """

    def __init__(
        self,
        gpu_regions: Sequence[torch.Tensor],
        cpu_regions: Sequence[torch.Tensor],
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        dma_rows: int | None = None,
    ) -> None:
        super().__init__(gpu_regions, cpu_regions)
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 1:
            raise ConfigError(f"staging_bytes must be a positive int, got {staging_bytes!r}")
        self._device = self._gpu[0].device
        for r, t in enumerate(self._gpu):
            if t.device.type != "cuda" or t.device != self._device:
                raise LayoutError(
                    f"gpu region {r} is on {t.device}; all gpu regions must share one CUDA device"
                )
        for r, t in enumerate(self._cpu):
            if t.device.type != "cpu":
                raise LayoutError(f"cpu region {r} is on {t.device}, expected cpu")
        self.host_slabs = host_slabs(self._cpu)
        self.dma_rows = dma_rows
        # Every CUDA call below runs with the KV tensors' device current: on a thread whose
        # current device is GPU 0, it would create a context (~0.5 GiB) there (TP rank > 0).
        with torch.cuda.device(self._device):
            unpinned = [r for s in self.host_slabs if not s.rows.is_pinned() for r in s.regions]
            if unpinned:
                raise TransferError(
                    f"cpu regions {unpinned} are not pinned: asynchronous copies need page-locked memory "
                    "(allocate the CPU tier with pinning enabled)"
                )
            self._streams = {d: torch.cuda.Stream(device=self._device, priority=0) for d in Direction}
        self._staging = {d: Staging(self._device, staging_bytes) for d in Direction}
        device = self._device
        self._bridges = {
            d: EventBridge(f"tiered-kv-{d.value}-waiter", on_start=lambda: torch.cuda.set_device(device))
            for d in Direction
        }

    @property
    def block_major(self) -> bool:
        """True when the CPU regions tile one block-major slab (one DMA per run of slots, all regions)."""
        return len(self.host_slabs) == 1 and len(self.host_slabs[0].regions) > 1

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of one direction (for profiling and tests)."""
        return self._streams[direction]

    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        stream = self._streams[direction]
        staging = self._staging[direction]
        keep: list[torch.Tensor] = []

        def index(ids: np.ndarray) -> torch.Tensor:
            return self._device_index(ids, keep)

        error: TransferError | None = None
        with torch.cuda.device(self._device):
            ready = self._ready_event(compute)
            # blocking=True: the waiter thread sleeps in synchronize() instead of spinning a core.
            done = torch.cuda.Event(blocking=True)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                try:
                    if direction is Direction.STORE:
                        enqueue_store(self._gpu, self.host_slabs, src, dst, staging, index, self.dma_rows)
                    else:
                        enqueue_load(self._gpu, self.host_slabs, src, dst, staging, index, self.dma_rows)
                except Exception as exc:
                    # Part of the batch may be queued already: report the failure
                    # only after `done`, when none of it can still be running.
                    error = TransferError(
                        f"{direction.value} of {len(src)} blocks failed to enqueue: {exc!r}"
                    )
                    error.__cause__ = exc
                done.record(stream)
        if staging.buffer is not None:
            keep.append(staging.buffer)
        handle.event = done
        self._bridges[direction].watch(done, handle.future, loop, self._resolve, error=error, keepalive=keep)

    def _ready_event(self, compute: Compute) -> torch.cuda.Event:
        """The event the copy stream waits on: the caller's, or one recorded now on its stream."""
        if isinstance(compute, torch.cuda.Event):
            return compute
        stream = torch.cuda.current_stream(self._device) if compute is None else compute
        if stream.device != self._device:
            raise TransferError(f"compute stream is on {stream.device} but the KV tensors are on {self._device}")
        ready = torch.cuda.Event()
        ready.record(stream)
        return ready

    def _release(self) -> None:
        for bridge in self._bridges.values():
            bridge.stop()
        with torch.cuda.device(self._device):  # frees device memory: the right device current
            for staging in self._staging.values():
                staging.release()

    def _device_index(self, ids: np.ndarray, keep: list[torch.Tensor]) -> torch.Tensor:
        # Pinned source + non_blocking: a pageable or synchronous upload would make
        # this (loop) thread wait for the copy stream, i.e. for the compute stream.
        host = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).pin_memory()
        dev = host.to(self._device, non_blocking=True)
        keep += (host, dev)
        return dev


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


class Staging:
    """A reusable device buffer, handed out as ``[n, width]`` views of at most ``limit_bytes``.

    Reusing one buffer across chunks, regions and batches is safe because all of
    them run in order on one stream. Device-agnostic, so CPU tests can drive it.
    """

    def __init__(self, device: torch.device, limit_bytes: int) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self.buffer: torch.Tensor | None = None

    def rows_per_chunk(self, width: int) -> int:
        """Rows of ``width`` bytes per chunk; one chunk exceeds the limit only when one row does."""
        return max(1, self.limit_bytes // max(width, 1))

    def view(self, rows: int, width: int) -> torch.Tensor:
        nbytes = rows * width
        buf = self.buffer
        if buf is None or buf.numel() < nbytes:
            # Allocated while the copy stream is current, so the caching allocator
            # ties it (and the memory of any buffer it replaces) to that stream.
            # Doubling bounds the regrowths.
            size = max(nbytes, min(self.limit_bytes, 2 * (0 if buf is None else buf.numel())))
            buf = self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buf[:nbytes].view(rows, width)

    def release(self) -> None:
        self.buffer = None


Index = Callable[[np.ndarray], torch.Tensor]


def enqueue_store(
    gpu: Sequence[torch.Tensor], slabs: Sequence[HostSlab], gpu_ids: np.ndarray, cpu_slots: np.ndarray,
    staging: Staging, index: Index, dma_rows: int | None = None,
) -> None:  # fmt: skip
    """Queue GPU rows -> CPU slots on the current stream: gather into staging, one DMA per run of slots
    (cut at multiples of ``dma_rows``, where the slab's registered chunks end)."""
    plan = _Plan(cpu_slots, gpu_ids, direct_ok=len(slabs[0].regions) == 1, index=index, dma_rows=dma_rows)
    for slab in slabs:
        for g0, s0, n in plan.direct:
            slab.rows[s0 : s0 + n].copy_(gpu[slab.regions[0]][g0 : g0 + n], non_blocking=True)
        for stage, ids, spans in plan.staged(slab.width, staging):
            for r, off in zip(slab.regions, slab.offsets, strict=True):
                g = gpu[r]
                cols = stage[:, off : off + int(g.shape[1])]
                if isinstance(ids, int):  # consecutive GPU rows: a strided device copy, no index
                    gw, cw = _widen(g[ids : ids + len(stage)], cols)
                    cw.copy_(gw)
                else:
                    gw, cw = _widen(g, cols)
                    torch.index_select(gw, 0, ids, out=cw)
            for o, first, length in spans:
                slab.rows[first : first + length].copy_(stage[o : o + length], non_blocking=True)


def enqueue_load(
    gpu: Sequence[torch.Tensor], slabs: Sequence[HostSlab], cpu_slots: np.ndarray, gpu_ids: np.ndarray,
    staging: Staging, index: Index, dma_rows: int | None = None,
) -> None:  # fmt: skip
    """Queue CPU slots -> GPU rows on the current stream: one DMA per run of slots (see enqueue_store), then scatter."""
    plan = _Plan(cpu_slots, gpu_ids, direct_ok=len(slabs[0].regions) == 1, index=index, dma_rows=dma_rows)
    for slab in slabs:
        for g0, s0, n in plan.direct:
            gpu[slab.regions[0]][g0 : g0 + n].copy_(slab.rows[s0 : s0 + n], non_blocking=True)
        for stage, ids, spans in plan.staged(slab.width, staging):
            for o, first, length in spans:
                stage[o : o + length].copy_(slab.rows[first : first + length], non_blocking=True)
            for r, off in zip(slab.regions, slab.offsets, strict=True):
                g = gpu[r]
                cols = stage[:, off : off + int(g.shape[1])]
                if isinstance(ids, int):
                    cw, gw = _widen(cols, g[ids : ids + len(stage)])
                    gw.copy_(cw)
                else:
                    cw, gw = _widen(cols, g)
                    gw.index_copy_(0, ids, cw)


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
