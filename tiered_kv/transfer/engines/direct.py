"""DirectCopyEngine: the direct road (issue 46, ``copy_path == "direct"``), GPU rows straight to pinned slab rows.

For GPU layouts whose rows are big enough to go to the link on their own: one region per block id (a
block-outermost "packed" layout, one region ``[num_blocks, row_bytes]``), or every region's row at least
``DIRECT_MIN_ROW`` (1 MiB; at ~0.75 us of copy engine per descriptor, 1 MiB rows reach ~0.96 of the link,
256 KiB rows ~0.84: shared/gpu/copy-path-design.md 2.2). No kernel and no staging: each call is ONE native
call (``core.DirectCopier.submit``, native/direct_copy.hpp) that, without the GIL, checks the ids, plans
one descriptor per run of slots consecutive on both sides (per region, cut at ``dma_rows``), makes the
copy stream wait for the ready event and issues one ``cuMemcpyBatchAsync`` plus a done-event record.
No torch.cuda call per call except reading the current stream when ``compute`` is None.

``road="staged"`` (or ``"auto"`` for rows under ``DIRECT_MIN_ROW``): small rows go through a ring of
staging chunks per direction instead, one capped-kernel launch and one batch per chunk from the same native
submit (staged_road.py, ring_kernel.py, native/staged_issue.hpp); ``copy_path`` then names the road, its
threshold, ring and grid. Fake driver only until its Triton launch is pinned and measured on a GPU.

Calls in flight: at most ``max_inflight`` (default 4) calls per direction are issued to that direction's copy
stream; a later one is parked in the native copier (its readiness recorded at submit) and issued by the
completion thread as soon as a slot frees. ``submit_*`` never blocks the loop.

Completion: a native thread per direction waits on the done events in FIFO order and writes an eventfd;
the loop watches it (``loop.add_reader``) and resolves every future up to the completed sequence number,
one wakeup per burst. Ordering is the CUDA engine's contract: the copy stream waits for ``compute`` (an
event, or a stream: an event is recorded on it at submit), else for the submitting thread's current stream.

``compute`` may also be a ``RawHandle``: a raw CUDA event (or stream) handle. ``driver="fake:VERSION"``
runs the same engine over the native fake driver (tests only): CPU tensors stand in for GPU memory, and
``compute`` is None (no ordering) or a ``RawHandle`` of ``core.fake_cuda``'s.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...core import core
from ...errors import ConfigError, LayoutError, TransferError
from .base import Compute, CopyEngine, CopyHandle, Direction, check_compute, is_event
from .ring_kernel import DIRECT_MIN_ROW, ring_road
from .staged import host_slabs
from .staged_road import attach_staged

# Calls issued to the copy stream per direction; later ones are parked natively, in order, and issued by the
# completion thread as slots free (so the link always has the next calls queued: copy-path-design.md 2.1.7).
MAX_INFLIGHT = 4
_STORE, _LOAD = 0, 1
_NONE, _EVENT, _STREAM = 0, 1, 2


@dataclass(frozen=True)
class RawHandle:
    """A raw ``CUevent`` (or, with ``stream=True``, ``CUstream``) handle a direct copy is ordered after."""

    handle: int
    stream: bool = False


def direct_eligible(gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor], min_row: int = DIRECT_MIN_ROW) -> bool:
    """True when every GPU region can go straight to the slab: one region per block id, or every region's
    row at least ``min_row`` bytes; bytes adjacent within a row on both sides; the CPU rows addressable."""
    if not gpu or len(gpu) != len(cpu):
        return False
    if len(gpu) > 1 and any(int(g.shape[1]) < min_row for g in gpu):
        return False
    if any(t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1) for t in (*gpu, *cpu)):
        return False
    try:
        host_slabs(cpu)
    except LayoutError:
        return False
    return True


def region_geometry(gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Per region: (gpu base, gpu row stride, row bytes, slab base, slab row stride, column in the slab row)."""
    out: list[tuple[int, ...]] = [()] * len(gpu)
    for slab in host_slabs(cpu):
        rows = slab.rows
        host_stride = int(rows.stride(0)) if rows.shape[0] > 1 else slab.width
        for r, col in zip(slab.regions, slab.offsets, strict=True):
            g = gpu[r]
            width = int(g.shape[1])
            gpu_stride = int(g.stride(0)) if g.shape[0] > 1 else width
            out[r] = (g.data_ptr(), gpu_stride, width, rows.data_ptr(), host_stride, col)
    return out


class DirectCopyEngine(CopyEngine):
    """GPU <-> pinned slab copies as batch descriptors from one native submit per call."""

    copy_path = "direct"

    def __init__(
        self, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor], *,
        dma_rows: int | None = None, driver: str = "cuda", max_inflight: int = MAX_INFLIGHT, road: str = "direct",
        chunk_bytes: int = 8 << 20,
    ) -> None:  # fmt: skip
        super().__init__(gpu_regions, cpu_regions)
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            raise ConfigError(f"max_inflight (calls in flight per direction) must be an integer >= 1, got {max_inflight!r}")
        if not direct_eligible(self._gpu, self._cpu, min_row=0):
            raise LayoutError("the direct copy path needs GPU rows with adjacent bytes and addressable CPU slab rows")
        self._fake = driver.startswith("fake:")
        device = 0
        if not self._fake:
            device = self._check_cuda()
        self.dma_rows = dma_rows
        self._device_index = device
        self._copier = core.DirectCopier(driver, device, region_geometry(self._gpu, self._cpu),
                                         self.num_blocks, self.num_slots, int(dma_rows or 0), max_inflight)  # fmt: skip
        self._keep: list[torch.Tensor] = []  # the staged road's buffers, which the native copier addresses
        try:
            self._take_road(road, max_inflight, chunk_bytes)
        except BaseException:
            self._copier.close()
            raise
        self._waiting: tuple[deque, deque] = (deque(), deque())  # per direction: (seq, future), in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self.wakeups = 0  # loop wakeups that resolved calls (one per burst of completions)

    def _take_road(self, road: str, max_inflight: int, chunk_bytes: int) -> None:
        """``direct`` (every row a descriptor), ``staged`` (small rows through a staging ring and the capped
        kernel), or ``auto`` (staged unless every row is >= DIRECT_MIN_ROW or the block is one region)."""
        if road not in ("direct", "staged", "auto"):
            raise ConfigError(f"road must be direct, staged or auto, got {road!r}")
        if road == "staged" or (road == "auto" and ring_road(self._gpu).startswith("staged")):
            self.copy_path, self._keep = attach_staged(self._copier, self._gpu, self._cpu, fake=self._fake,
                                                       max_inflight=max_inflight, chunk_bytes=chunk_bytes)  # fmt: skip

    def _check_cuda(self) -> int:
        dev = self._gpu[0].device
        for r, t in enumerate(self._gpu):
            if t.device.type != "cuda" or t.device != dev:
                raise LayoutError(f"gpu region {r} is on {t.device}; all gpu regions must share one CUDA device")
        unpinned = [r for r, t in enumerate(self._cpu) if t.device.type != "cpu" or not t.is_pinned()]
        if unpinned:
            raise TransferError(f"cpu regions {unpinned} are not pinned CPU memory: asynchronous copies need "
                                "page-locked memory (allocate the CPU tier with pinning enabled)")  # fmt: skip
        self._device = dev
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.init()  # the primary context the copier retains is torch's
        return int(index)

    def stream_handle(self, direction: Direction) -> int:
        """The raw copy stream of one direction (tests hold it on the fake driver)."""
        return int(self._copier.stream(_STORE if direction is Direction.STORE else _LOAD))

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of one direction as a torch stream (real driver only: profiling and tests)."""
        if self._fake:
            raise TransferError("the fake driver's streams are not CUDA streams: use stream_handle")
        return torch.cuda.ExternalStream(self.stream_handle(direction), device=self._device)

    def last_descriptors(self, direction: Direction) -> int:
        """Descriptors the last call of ``direction`` issued (one per run and dense region)."""
        return int(self._copier.last_descriptors(_STORE if direction is Direction.STORE else _LOAD))

    def queued(self, direction: Direction) -> tuple[int, int]:
        """(calls issued to the copy stream and not completed, calls parked for a free slot) of ``direction``."""
        return tuple(self._copier.inflight(_STORE if direction is Direction.STORE else _LOAD))

    @property
    def max_inflight(self) -> int:
        return int(self._copier.max_inflight)

    @property
    def batched(self) -> bool:
        """Whether the driver has cuMemcpyBatchAsync (12.8+); else one cuMemcpyAsync per descriptor."""
        return bool(self._copier.batched)

    # The native submit checks the ids (the messages of check_id_arrays): no numpy pass here.
    def submit_store(self, gpu_ids, cpu_slots, *, compute: Compute = None) -> CopyHandle:
        """Copy GPU blocks ``gpu_ids[i]`` into CPU slots ``cpu_slots[i]``, after ``compute``."""
        return self._submit(Direction.STORE, _ids(gpu_ids), _ids(cpu_slots), self._checked(compute))

    def submit_load(self, cpu_slots, gpu_ids, *, compute: Compute = None) -> CopyHandle:
        """Copy CPU slots ``cpu_slots[i]`` into GPU blocks ``gpu_ids[i]``, after ``compute``."""
        return self._submit(Direction.LOAD, _ids(cpu_slots), _ids(gpu_ids), self._checked(compute))

    def _checked(self, compute: Compute) -> Compute:
        if not isinstance(compute, RawHandle):
            check_compute(compute)
        return compute

    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        if self._loop is None:
            loop.add_reader(self._copier.fd, self._on_completion)
            self._loop = loop
        elif self._loop is not loop:
            raise TransferError("a DirectCopyEngine serves the event loop it was first used on, not another")
        ready, raw = self._ready(compute)
        d = _STORE if direction is Direction.STORE else _LOAD
        seq = self._copier.submit(d, src, dst, ready, raw)  # TransferError here: nothing was queued
        self._waiting[d].append((seq, handle.future))

    def _ready(self, compute: Compute) -> tuple[int, int]:
        """What the copy stream waits on, as (kind, raw handle)."""
        if isinstance(compute, RawHandle):
            return (_STREAM if compute.stream else _EVENT), int(compute.handle)
        if self._fake:
            if compute is not None:
                raise TransferError("the fake driver orders copies only after a RawHandle of core.fake_cuda's")
            return _NONE, 0
        if compute is None:
            return _STREAM, int(torch.cuda.current_stream(self._device).cuda_stream)
        if isinstance(compute, torch.cuda.Stream):
            if compute.device != self._device:
                raise TransferError(f"compute stream is on {compute.device} but the KV tensors are on {self._device}")
            return _STREAM, int(compute.cuda_stream)
        if isinstance(compute, torch.cuda.Event):
            return _EVENT, int(compute.cuda_event)
        if is_event(compute):  # the generic torch.Event (vLLM's): its raw cudaEvent_t
            return _EVENT, int(compute.event_id)
        raise TransferError(f"compute of type {type(compute).__name__} cannot order a direct copy")

    def _on_completion(self) -> None:
        """Loop callback (the eventfd is readable): resolve every call up to each direction's counter."""
        store_done, load_done, errors = self._copier.poll()
        failed = {(d, seq): msg for d, seq, msg in errors}
        resolved = False
        for d, done in ((_STORE, store_done), (_LOAD, load_done)):
            queue = self._waiting[d]
            while queue and queue[0][0] <= done:
                seq, future = queue.popleft()
                msg = failed.get((d, seq))
                what = "store" if d == _STORE else "load"
                error = None if msg is None else TransferError(f"direct {what} (call {seq}) failed: {msg}")
                self._resolve(future, error)
                resolved = True
        self.wakeups += resolved

    def _release(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._copier.fd)
        self._copier.close()  # every call has completed (aclose drained them): the threads exit at once


def _ids(ids) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.cpu().numpy()
    return ids if isinstance(ids, np.ndarray) else np.asarray(ids)
