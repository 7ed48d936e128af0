"""CUDAStreamEngine: GPU <-> pinned CPU copies on dedicated low-priority streams.

Ordering against the model (the part that silently garbles outputs when wrong,
vLLM #45704): at submit time an event is recorded on the caller's current
(compute) stream and the copy stream waits on it before touching any block.
A store therefore reads what the compute stream wrote, and a load never
overwrites a block the compute stream may still be reading.

Scattered GPU ids are gathered (store) or scattered (load) on the GPU through
a reusable device staging buffer, so the PCIe transfer is one DMA per run of
consecutive CPU slots instead of one per block. Trade-off: every staged byte
makes one extra pass through HBM (~3 TB/s, a few percent of the PCIe time)
and the engine holds up to ``staging_bytes`` of GPU memory per direction; in
return small blocks (16 KiB) do not pay a launch and a short, inefficient DMA
each. Runs that are consecutive on both sides skip the staging entirely.
Scattered CPU slots still cost one DMA per slot, so the CPU tier should hand
out slots in runs.

Completion: each batch records a (blocking-sync) event on its stream; the
EventBridge waiter thread for that direction synchronises it and resolves the
future on the loop. ``handle.event`` lets a compute stream wait on a load
directly (``torch.cuda.current_stream().wait_event(handle.event)``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch

from tiered_kv.errors import LayoutError, TransferError
from tiered_kv.transfer.base import CopyEngine, CopyHandle, Direction
from tiered_kv.transfer.bridge import EventBridge
from tiered_kv.transfer.plan import Run, dst_runs, spans, src_runs, widen_pair

DEFAULT_STAGING_BYTES = 64 * 1024 * 1024


class CUDAStreamEngine(CopyEngine):
    """Copies on two low-priority CUDA streams (store, load); needs pinned CPU regions."""

    def __init__(
        self,
        gpu_regions: Sequence[torch.Tensor],
        cpu_regions: Sequence[torch.Tensor],
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        super().__init__(gpu_regions, cpu_regions)
        self._device = self._gpu[0].device
        for r, t in enumerate(self._gpu):
            if t.device.type != "cuda" or t.device != self._device:
                raise LayoutError(
                    f"gpu region {r} is on {t.device}; all gpu regions must share one CUDA device"
                )
        for r, t in enumerate(self._cpu):
            if t.device.type != "cpu":
                raise LayoutError(f"cpu region {r} is on {t.device}, expected cpu")
        unpinned = [r for r, t in enumerate(self._cpu) if not t.is_pinned()]
        if unpinned:
            raise TransferError(
                f"cpu regions {unpinned} are not pinned: asynchronous copies need page-locked memory "
                "(allocate the CPU tier with pinning enabled)"
            )
        least_priority, _greatest = torch.cuda.Stream.priority_range()
        with torch.cuda.device(self._device):
            self._streams = {
                d: torch.cuda.Stream(device=self._device, priority=least_priority) for d in Direction
            }
        self._staging = {d: Staging(self._device, int(staging_bytes)) for d in Direction}
        self._bridges = {d: EventBridge(f"tiered-kv-{d.value}-waiter") for d in Direction}

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        """The copy stream of one direction (for profiling and tests)."""
        return self._streams[direction]

    def _launch(
        self, direction: Direction, src: list[int], dst: list[int], handle: CopyHandle,
        loop: asyncio.AbstractEventLoop,
    ) -> None:  # fmt: skip
        stream = self._streams[direction]
        keep: list[torch.Tensor] = []

        def index(ids: list[int]) -> torch.Tensor:
            return self._device_index(ids, keep)

        error: TransferError | None = None
        with torch.cuda.device(self._device):
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
            # blocking=True: the waiter thread sleeps in synchronize() instead of spinning a core.
            done = torch.cuda.Event(blocking=True)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                try:
                    enqueue = enqueue_store if direction is Direction.STORE else enqueue_load
                    enqueue(self._gpu, self._cpu, src, dst, self._staging[direction], index)
                except Exception as exc:
                    # Part of the batch may be queued already: report the failure
                    # only after `done`, when none of it can still be running.
                    error = TransferError(
                        f"{direction.value} of {len(src)} blocks failed to enqueue: {exc!r}"
                    )
                    error.__cause__ = exc
                done.record(stream)
        handle.event = done
        self._bridges[direction].watch(done, handle.future, loop, self._resolve, error=error, keepalive=keep)

    def _release(self) -> None:
        for bridge in self._bridges.values():
            bridge.stop()
        for staging in self._staging.values():
            staging.release()

    def _device_index(self, ids: list[int], keep: list[torch.Tensor]) -> torch.Tensor:
        # Pinned source + non_blocking: a pageable or synchronous upload would make
        # this (loop) thread wait for the copy stream, i.e. for the compute stream.
        if not ids:
            return torch.empty(0, dtype=torch.int64, device=self._device)
        host = torch.tensor(ids, dtype=torch.int64).pin_memory()
        dev = host.to(self._device, non_blocking=True)
        keep += (host, dev)
        return dev


class Staging:
    """A reusable device buffer, handed out in chunks of at most ``limit_bytes``.

    Reusing one buffer across chunks, regions and batches is safe because all of
    them run in order on one stream. Device-agnostic, so CPU tests can drive it.
    """

    def __init__(self, device: torch.device, limit_bytes: int) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self._buf: torch.Tensor | None = None

    def chunks(self, rows: int, block_bytes: int):
        """Yield (offset, n, view [n, block_bytes]) covering ``rows`` rows."""
        per_chunk = max(1, self.limit_bytes // block_bytes)
        for off in range(0, rows, per_chunk):
            n = min(per_chunk, rows - off)
            yield off, n, self._take(n * block_bytes).view(n, block_bytes)

    def release(self) -> None:
        self._buf = None

    def _take(self, nbytes: int) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < nbytes:
            # Allocated while the copy stream is current, so the caching allocator
            # ties it (and the memory of any buffer it replaces) to that stream.
            # Doubling bounds the regrowths; one chunk may exceed the limit only
            # when a single block does.
            size = max(nbytes, min(self.limit_bytes, 2 * (0 if buf is None else buf.numel())))
            buf = self._buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]


Index = Callable[[list[int]], torch.Tensor]


def enqueue_store(
    gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor], gpu_ids: list[int], cpu_slots: list[int],
    staging: Staging, index: Index,
) -> None:  # fmt: skip
    """Queue GPU rows -> CPU rows on the current stream (gather, then one DMA per CPU run)."""
    direct, st_gpu, st_cpu = _split_runs(dst_runs(gpu_ids, cpu_slots), staged_side="src")
    idx = index(st_gpu)
    for g, c in zip(gpu, cpu, strict=True):
        for run in direct:
            c[run.dst[0] : run.dst[0] + len(run.dst)].copy_(
                g[run.src[0] : run.src[0] + len(run.src)], non_blocking=True
            )
        for off, n, stage in staging.chunks(len(st_gpu), int(g.shape[1])):
            gw, sw = widen_pair(g, stage)
            torch.index_select(gw, 0, idx[off : off + n], out=sw)
            for o, first, length in spans(st_cpu[off : off + n]):
                c[first : first + length].copy_(stage[o : o + length], non_blocking=True)


def enqueue_load(
    gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor], cpu_slots: list[int], gpu_ids: list[int],
    staging: Staging, index: Index,
) -> None:  # fmt: skip
    """Queue CPU rows -> GPU rows on the current stream (one DMA per CPU run, then scatter)."""
    direct, st_cpu, st_gpu = _split_runs(src_runs(cpu_slots, gpu_ids), staged_side="dst")
    idx = index(st_gpu)
    for g, c in zip(gpu, cpu, strict=True):
        for run in direct:
            g[run.dst[0] : run.dst[0] + len(run.dst)].copy_(
                c[run.src[0] : run.src[0] + len(run.src)], non_blocking=True
            )
        for off, n, stage in staging.chunks(len(st_cpu), int(g.shape[1])):
            for o, first, length in spans(st_cpu[off : off + n]):
                stage[o : o + length].copy_(c[first : first + length], non_blocking=True)
            sw, gw = widen_pair(stage, g)
            gw.index_copy_(0, idx[off : off + n], sw)


def _split_runs(runs: list[Run], *, staged_side: str) -> tuple[list[Run], list[int], list[int]]:
    """Runs contiguous on both sides are copied directly; the rest go through staging.

    ``staged_side`` is the GPU side ("src" for stores, "dst" for loads): a run
    needs staging when its GPU ids are not consecutive. Returns the direct runs
    and the staged rows as flat (src ids, dst ids) lists in run order.
    """
    direct: list[Run] = []
    st_src: list[int] = []
    st_dst: list[int] = []
    for run in runs:
        if run.src_contiguous if staged_side == "src" else run.dst_contiguous:
            direct.append(run)
        else:
            st_src.extend(run.src)
            st_dst.extend(run.dst)
    return direct, st_src, st_dst
