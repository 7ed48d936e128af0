"""HostCopyEngine: the copy engine for CPU-only machines (and CI).

A batch is split into runs of consecutive CPU slots (the tier manager hands out
ascending slots, so a batch is usually one run); each run is one bulk op per
region: a slice copy when the engine's block ids are consecutive too, else one
``index_select(out=...)`` gather (store) or one numpy row scatter (load; CPU
``index_copy_`` walks elements and is ~5x slower). Many short runs fall back to
one gather + scatter per region.

Small batches run inline on the calling (event-loop) thread: a thread hand-off
costs 50-300 us here (more under load), as much as copying 1-4 MiB, and a memcpy of at most
``inline_bytes`` (4 MiB) holds the loop for about a millisecond at most. Larger batches
go to one worker thread per direction. Either way a direction's batches finish
in submission order: a batch runs inline only when its direction's worker is idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tiered_kv.errors import LayoutError, TransferError
from tiered_kv.transfer.base import Compute, CopyEngine, CopyHandle, Direction

log = logging.getLogger(__name__)

DEFAULT_INLINE_BYTES = 1 << 22
_MANY_RUNS = 8  # more runs than this (and than a quarter of the rows): one gather + scatter per region


class HostCopyEngine(CopyEngine):
    """Copies with torch / numpy CPU ops, inline for small batches or on worker threads the engine owns."""

    def __init__(
        self,
        gpu_regions: Sequence[torch.Tensor],
        cpu_regions: Sequence[torch.Tensor],
        *,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        super().__init__(gpu_regions, cpu_regions)
        for side, regions in (("gpu", self._gpu), ("cpu", self._cpu)):
            for r, t in enumerate(regions):
                if t.device.type != "cpu":
                    raise LayoutError(
                        f"HostCopyEngine needs CPU tensors but {side} region {r} is on {t.device} (use the cuda engine)"
                    )
        self.inline_bytes = inline_bytes
        self._gpu_np = [t.numpy() for t in self._gpu]
        self._cpu_np = [t.numpy() for t in self._cpu]
        self._executors = {
            d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tiered-kv-{d.value}") for d in Direction
        }
        self._queued = {d: 0 for d in Direction}  # batches handed to a worker and not yet reported

    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        # ``compute`` (a CUDA event or stream, type-checked by the base) orders nothing here:
        # the "GPU" tensors are CPU memory, written synchronously by the caller.
        if direction is Direction.STORE:
            job = (_store_rows, self._gpu, self._cpu, self._gpu_np, self._cpu_np, src, dst)
        else:
            job = (_load_rows, self._cpu, self._gpu, self._cpu_np, self._gpu_np, src, dst)
        if handle.nbytes <= self.inline_bytes and self._queued[direction] == 0:
            error = _run(job, handle.direction, len(src))
            loop.call_soon(self._resolve, handle.future, error)
            return
        self._queued[direction] += 1
        self._executors[direction].submit(self._threaded, job, handle, loop)

    def _threaded(self, job: tuple, handle: CopyHandle, loop: asyncio.AbstractEventLoop) -> None:
        """Worker-thread body: copy, then report to the loop. Never raises."""
        error = _run(job, handle.direction, handle.nbytes // max(self.bytes_per_block, 1))
        try:
            loop.call_soon_threadsafe(self._resolve_threaded, handle, error)
        except RuntimeError:  # the loop closed under us: nobody is left to tell but the log
            log.error("event loop closed before a %s batch could be reported (error=%r)", handle.direction.value, error)

    def _resolve_threaded(self, handle: CopyHandle, error: BaseException | None) -> None:
        self._queued[handle.direction] -= 1
        self._resolve(handle.future, error)

    def _release(self) -> None:
        # Every job has finished (aclose drained them), so the idle workers exit
        # promptly; wait=False keeps the join off the event loop.
        for executor in self._executors.values():
            executor.shutdown(wait=False)


def _run(job: tuple, direction: Direction, count: int) -> BaseException | None:
    try:
        job[0](*job[1:])
    except Exception as exc:
        error = TransferError(f"{direction.value} of {count} blocks failed: {exc!r}")
        error.__cause__ = exc
        return error
    return None


def run_bounds(ids: np.ndarray) -> np.ndarray:
    """``[0, ..., n]``: boundaries of the runs of consecutive ids, in the given order."""
    if len(ids) == 0:
        return np.zeros(1, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    return np.concatenate(([0], cuts, [len(ids)]))


def _consecutive(ids: np.ndarray) -> bool:
    return len(ids) > 0 and int(ids[-1]) - int(ids[0]) == len(ids) - 1 and bool(np.all(np.diff(ids) == 1))


def _store_rows(gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor], gpu_np: Sequence[np.ndarray],
                cpu_np: Sequence[np.ndarray], gpu_ids: np.ndarray, cpu_slots: np.ndarray) -> None:  # fmt: skip
    """GPU rows -> CPU rows: per run of consecutive CPU slots, one gather per region."""
    bounds = run_bounds(cpu_slots)
    if len(bounds) - 1 > max(_MANY_RUNS, len(cpu_slots) // 4):
        for g, c in zip(gpu_np, cpu_np, strict=True):
            c[cpu_slots] = g[gpu_ids]
        return
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        s, d0 = gpu_ids[a:b], int(cpu_slots[a])
        if _consecutive(s):
            s0 = int(s[0])
            for g, c in zip(gpu, cpu, strict=True):
                c[d0 : d0 + b - a].copy_(g[s0 : s0 + b - a])
        else:
            idx = torch.from_numpy(np.ascontiguousarray(s))
            for g, c in zip(gpu, cpu, strict=True):
                torch.index_select(g, 0, idx, out=c[d0 : d0 + b - a])


def _load_rows(cpu: Sequence[torch.Tensor], gpu: Sequence[torch.Tensor], cpu_np: Sequence[np.ndarray],
               gpu_np: Sequence[np.ndarray], cpu_slots: np.ndarray, gpu_ids: np.ndarray) -> None:  # fmt: skip
    """CPU rows -> GPU rows: per run of consecutive CPU slots, one numpy row scatter per region."""
    bounds = run_bounds(cpu_slots)
    if len(bounds) - 1 > max(_MANY_RUNS, len(cpu_slots) // 4):
        for c, g in zip(cpu_np, gpu_np, strict=True):
            g[gpu_ids] = c[cpu_slots]
        return
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        d, s0 = gpu_ids[a:b], int(cpu_slots[a])
        if _consecutive(d):
            d0 = int(d[0])
            for c, g in zip(cpu, gpu, strict=True):
                g[d0 : d0 + b - a].copy_(c[s0 : s0 + b - a])
        else:
            for c, g in zip(cpu_np, gpu_np, strict=True):
                g[d] = c[s0 : s0 + b - a]
