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

Throughput (issue 27, defect D): the DMAs of staged chunks run on a second stream per direction, and
staging has two buffers that alternate chunk by chunk (``CudaLanes``): chunk k+1's gather kernel fills
one buffer while chunk k's DMA drains the other, instead of gather and DMA taking turns on one stream.
The batches' GPU index tensors are uploaded from a preallocated pinned ring (transfer/engines/index_ring.py),
not a ``pin_memory()`` per batch, which takes the driver's lock each time.

Completion: each batch records a (blocking-sync) event on its stream; the
EventBridge waiter thread for that direction synchronises it and resolves the
future on the loop. ``handle.event`` lets a compute stream wait on a load
directly (``torch.cuda.current_stream().wait_event(handle.event)``).
The enqueue functions (staged.py) are device-agnostic, so CPU tests drive the same code.

The copy path (issue 38) is chosen once here and named by ``copy_path``: ``table`` (one Triton launch
per staging chunk for every region, transfer/engines/table.py), ``table-direct`` (one launch per call, in place
in the pinned slab), or ``groups`` (the per-group index kernels above) where triton is absent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import torch

from ...errors import ConfigError, LayoutError, TransferError
from .base import Compute, CopyEngine, CopyHandle, Direction, check_compute, check_id_arrays, is_event
from .bridge import EventBridge
from .counted import Completions, CountedByCompletions
from .index_ring import IndexRing
from .staged import Lanes, Staging, enqueue_load, enqueue_store, gpu_groups, host_slabs
from .table import DeviceIds, build_table, choose_path, enqueue_table

DEFAULT_STAGING_BYTES = 64 * 1024 * 1024


class CUDAStreamEngine(CountedByCompletions, CopyEngine):
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
        copy_path: str = "auto",
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
        self.gpu_groups = [gpu_groups(self._gpu, slab) for slab in self.host_slabs]
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
            self._lanes = {d: CudaLanes(self._streams[d], torch.cuda.Stream(device=self._device, priority=0))
                           for d in Direction}  # fmt: skip
            self._rings = {d: IndexRing() for d in Direction}
            # Chosen once (transfer/engines/table.py): one launch per chunk where triton runs, else a launch per group.
            self.copy_path = choose_path(copy_path, self._device)
            self._tables = [build_table(self._gpu, slab, self._device) for slab in self.host_slabs] \
                if self.copy_path != "groups" else []  # fmt: skip
            self._ids = {d: DeviceIds(self._rings[d], self._device) for d in Direction} if self._tables else {}
        self._staging = {d: Staging(self._device, staging_bytes) for d in Direction}
        device = self._device
        self._bridges = {
            d: EventBridge(f"tiered-kv-{d.value}-waiter", on_start=lambda: torch.cuda.set_device(device))
            for d in Direction
        }
        self._counts = Completions()
        self._counted_finish = {d: _finisher(self._counts, d) for d in Direction}

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of one direction (for profiling and tests)."""
        return self._streams[direction]

    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        done, error, keep = self._enqueue(direction, src, dst, compute)
        handle.event = done
        self._bridges[direction].watch(done, handle.future, loop, self._resolve, error=error, keepalive=keep)

    # -- base.CountedCopies: the worker's loop-free copies (the waiter thread bumps a counter) -------------
    def start_copy(self, direction: Direction, src: np.ndarray, dst: np.ndarray, compute: Compute = None) -> int:
        if self._closed:
            raise TransferError(f"start_copy ({direction.value}) on a closed {type(self).__name__}")
        check_compute(compute)
        n = (self.num_blocks, self.num_slots) if direction is Direction.STORE else (self.num_slots, self.num_blocks)
        src, dst = check_id_arrays(src, dst, src_len=n[0], dst_len=n[1])  # a bad id must never reach a kernel
        done, error, keep = self._enqueue(direction, src, dst, compute)
        seq = self._counts.issue(direction)
        self._bridges[direction].watch(done, seq, _NOW, self._counted_finish[direction], error=error, keepalive=keep)
        return seq

    def _enqueue(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, compute: Compute,
    ) -> tuple[torch.cuda.Event, TransferError | None, list]:  # fmt: skip
        """Queue one batch on the direction's streams: (its done event, an enqueue error to report once
        the event has passed, the tensors to keep alive until then)."""
        stream = self._streams[direction]
        staging = self._staging[direction]
        keep: list[torch.Tensor] = []

        ring = self._rings[direction]

        def index(ids: np.ndarray) -> torch.Tensor:
            return self._device_index(ids, keep, ring)

        error: TransferError | None = None
        with torch.cuda.device(self._device):
            ready = self._ready_event(compute)
            # blocking=True: the waiter thread sleeps in synchronize() instead of spinning a core.
            done = torch.cuda.Event(blocking=True)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                try:
                    lanes = self._lanes[direction]
                    if self._tables:
                        enqueue_table(direction is Direction.LOAD, self._tables, self.host_slabs, src if
                                      direction is Direction.STORE else dst, dst if direction is Direction.STORE
                                      else src, self._ids[direction], keep, dma_rows=self.dma_rows, lanes=lanes,
                                      staging=staging if self.copy_path == "table" else None)  # fmt: skip
                    elif direction is Direction.STORE:
                        enqueue_store(self._gpu, self.host_slabs, src, dst, staging, index, self.dma_rows,
                                      self.gpu_groups, lanes)  # fmt: skip
                    else:
                        enqueue_load(self._gpu, self.host_slabs, src, dst, staging, index, self.dma_rows,
                                     self.gpu_groups, lanes)  # fmt: skip
                except Exception as exc:
                    # Part of the batch may be queued already: report the failure
                    # only after `done`, when none of it can still be running.
                    error = TransferError(
                        f"{direction.value} of {len(src)} blocks failed to enqueue: {exc!r}"
                    )
                    error.__cause__ = exc
                done.record(stream)
            ring.seal(done)  # the ids it uploaded stay put until this batch is done
        keep += staging.buffers
        return done, error, keep

    def _ready_event(self, compute: Compute) -> torch.cuda.Event:
        """The event the copy stream waits on: the caller's, or one recorded now on its stream."""
        if is_event(compute):  # torch.cuda.Event or the generic torch.Event: Stream.wait_event takes either
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

    def _device_index(self, ids: np.ndarray, keep: list[torch.Tensor], ring: IndexRing) -> torch.Tensor:
        # Pinned source + non_blocking: a pageable or synchronous upload would make this (loop) thread
        # wait for the copy stream, i.e. for the compute stream. From the ring: no pin_memory() per batch.
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        host = ring.take(ids)
        if host is None:  # the ring is full (or the batch is huge): a one-off pinned tensor
            host = torch.from_numpy(ids).pin_memory()
        dev = host.to(self._device, non_blocking=True)
        keep += (host, dev)
        return dev


class CudaLanes(Lanes):
    """The kernel lane on the engine's stream of a direction, the DMA lane on a second stream.

    Before a lane uses staging buffer ``b`` its stream waits for the event the other lane recorded after
    its last use of ``b`` (a chunk's DMA after its gather; a gather into ``b`` after the DMA that last
    read ``b``; the reverse for loads). ``finish`` makes the kernel stream, where the batch's done event
    is recorded, wait for the DMA stream.
    """

    def __init__(self, kernel: torch.cuda.Stream, dma: torch.cuda.Stream, buffers: int = 2) -> None:
        self._streams = {"kernel": kernel, "dma": dma}
        self._done = {lane: [torch.cuda.Event() for _ in range(buffers)] for lane in self._streams}
        self._recorded = {lane: [False] * buffers for lane in self._streams}

    def kernel(self):
        return torch.cuda.stream(self._streams["kernel"])

    def dma(self):
        return torch.cuda.stream(self._streams["dma"])

    def before(self, lane: str, b: int) -> None:
        other = "dma" if lane == "kernel" else "kernel"
        if self._recorded[other][b]:
            self._streams[lane].wait_event(self._done[other][b])

    def after(self, lane: str, b: int) -> None:
        self._done[lane][b].record(self._streams[lane])
        self._recorded[lane][b] = True

    def uses(self, buffer: torch.Tensor) -> None:
        if buffer is not None:  # the allocator must not hand it out again before the DMA stream is done
            buffer.record_stream(self._streams["dma"])

    def finish(self) -> None:
        self._streams["kernel"].wait_stream(self._streams["dma"])


class _Now:
    """The bridge's "loop" for counted copies: the waiter thread bumps the counter itself, no loop hop."""

    @staticmethod
    def call_soon_threadsafe(fn, *args) -> None:
        fn(*args)


_NOW = _Now()


def _finisher(counts: Completions, direction: Direction):
    def finish(seq: int, error: BaseException | None) -> None:
        counts.finish(direction, seq, None if error is None else str(error))

    return finish
