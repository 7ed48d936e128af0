"""HostCopyEngine: the copy engine for CPU-only machines (and CI).

Every batch is one native call (``core.Rows.copy``, native/rows.hpp): it checks the ids (in range,
no destination twice), then, without the GIL, copies each region's rows with memcpy, one call per
run consecutive on both sides. Single-threaded by design: torch's CPU ops (``index_select``, a
large ``copy_``) wake an intra-op pool per calling thread, whose threads compete with the model's
forward pass and, after an idle gap, took 8.2 ms for a 128 KiB gather that one thread does in 6.5 us.

Small batches may run inline on the calling (event-loop) thread: a thread hand-off costs 50-300 us
here (more under load), as much as copying 1-4 MiB, and a memcpy of at most ``inline_bytes``
(4 MiB) holds the loop for about a millisecond at most. ``copy_inline`` does it synchronously (the
cache's path with no suspension); a submitted batch that fits runs inline too and resolves its
future on the next loop turn. Larger batches go to one worker thread per direction. Either way a
direction's batches finish in submission order: a batch runs inline only when its direction's
worker is idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ...core import core
from ...errors import LayoutError, TransferError
from .base import Compute, CopyEngine, CopyHandle, Direction

log = logging.getLogger(__name__)

DEFAULT_INLINE_BYTES = 1 << 22
_MANY_RUNS = 8  # more runs than this (and than a quarter of the rows): one gather + scatter per region


class HostCopyEngine(CopyEngine):
    """Copies with torch / numpy CPU ops, inline for small batches or on worker threads the engine owns."""

    # The host engine's table is the native core's (core.Rows: each region's rows, built once here): one
    # native call per batch, every region's memcpy with the GIL released, no per-region Python.
    copy_path = "host-rows"

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
        self._rows = core.Rows(self._gpu_np, self._cpu_np, "gpu block id", "cpu slot")  # side 0: gpu, 1: cpu
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
        job = (self._rows.copy, 0 if direction is Direction.STORE else 1, src, dst)
        if handle.nbytes <= self.inline_bytes and self._queued[direction] == 0:
            error = _run(job, handle.direction, len(src))
            loop.call_soon(self._finish, handle, error)
            return
        self._queued[direction] += 1
        self._executors[direction].submit(self._threaded, job, handle, loop)

    def copy_inline(self, direction: Direction, src: np.ndarray, dst: np.ndarray) -> bool:
        """Copy now, on this thread, when the batch is small enough and its direction's worker is idle
        (so order holds); False, having done nothing, otherwise. ``src``/``dst`` are int64 arrays (the
        core checks them: TransferError). Raises TransferError as a submitted batch's future would."""
        if self._closed or self._queued[direction] or len(src) * self.bytes_per_block > self.inline_bytes:
            return False
        error = _run((self._rows.copy, 0 if direction is Direction.STORE else 1, src, dst), direction, len(src))
        if error is not None:
            raise error
        return True

    def copy_threaded(self, direction: Direction, src: np.ndarray, dst: np.ndarray, token: asyncio.Future,
                      done: Callable[[BaseException | None], None]) -> None:  # fmt: skip
        """Start the copy on the direction's worker (in order after the batches before it); once every
        byte has landed, ``done(error)`` runs on the loop: one hand-off, one wake-up, and no future of the
        engine's. ``token`` (the caller's future) counts as in flight until then, so ``aclose`` drains it.
        Call it only when ``copy_inline`` declined (it goes through ``_launch``, which then threads)."""
        if self._closed:
            raise TransferError(f"copy_threaded on a closed {type(self).__name__}")
        handle = _DirectHandle(token, len(src) * self.bytes_per_block, direction)
        handle.done = done
        self._pending.add(token)
        try:
            self._launch(direction, src, dst, handle, asyncio.get_running_loop(), None)
        except BaseException:
            self._pending.discard(token)
            raise

    def _finish(self, handle: CopyHandle, error: BaseException | None) -> None:
        """A batch has landed (on the loop): a direct one calls back, a submitted one resolves its future."""
        if type(handle) is not _DirectHandle:
            self._resolve(handle.future, error)
            return
        try:
            handle.done(error)
        finally:
            self._pending.discard(handle.future)
            if not self._pending and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    def _threaded(self, job: tuple, handle: CopyHandle, loop: asyncio.AbstractEventLoop) -> None:
        """Worker-thread body: copy, then report to the loop. Never raises."""
        error = _run(job, handle.direction, handle.nbytes // max(self.bytes_per_block, 1))
        try:
            loop.call_soon_threadsafe(self._resolve_threaded, handle, error)
        except RuntimeError:  # the loop closed under us: nobody is left to tell but the log
            log.error("event loop closed before a %s batch could be reported (error=%r)", handle.direction.value, error)

    def _resolve_threaded(self, handle: CopyHandle, error: BaseException | None) -> None:
        self._queued[handle.direction] -= 1
        self._finish(handle, error)

    def _release(self) -> None:
        # Every job has finished (aclose drained them), so the idle workers exit
        # promptly; wait=False keeps the join off the event loop.
        for executor in self._executors.values():
            executor.shutdown(wait=False)


class _DirectHandle(CopyHandle):
    """A ``copy_threaded`` batch: its future is the caller's, and ``done`` runs when it lands."""

    __slots__ = ("done",)


def _run(job: tuple, direction: Direction, count: int) -> BaseException | None:
    try:
        job[0](*job[1:])
    except Exception as exc:
        error = TransferError(f"{direction.value} of {count} blocks failed: {exc!r}")
        error.__cause__ = exc
        return error
    return None
