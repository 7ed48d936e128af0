"""The dispatcher: runs one transfer job through the handler registered for its (source, destination) media.

It holds no bookkeeping: the tier manager decides what moves where, the runners (transfer/runners/)
hand each job of a plan here, and the dispatcher runs it under the in-flight byte budget and reports
which blocks made it. Adding a tier adds handlers, not branches.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...byte_budget import ByteBudget
from ...errors import TransferError
from ...metrics import CacheMetrics

MEDIA = ("gpu", "cpu", "disk", "remote")
DIRECTIONS = {
    ("gpu", "cpu"): "gpu_to_cpu",
    ("cpu", "gpu"): "cpu_to_gpu",
    ("cpu", "disk"): "cpu_to_disk",
    ("disk", "cpu"): "disk_to_cpu",
    ("cpu", "remote"): "cpu_to_remote",
    ("remote", "cpu"): "remote_to_cpu",
}

# A handler runs one job and returns a per-block ok mask; it raises only for a fault that
# hit the whole batch, and only once nothing of the batch can still be in flight.
Handler = Callable[[Any], Awaitable[np.ndarray]]
# An inline handler runs one job on the calling thread and returns True once it has landed, or
# returns False having done nothing (the job must go through ``run``); it raises as a handler does.
InlineHandler = Callable[[Any], bool]
# A threaded starter hands one job to the engine's thread: ``starter(job, token, done)``; ``done(error)``
# runs on the loop once the job has landed, ``token`` is the caller's future (in flight until then).
ThreadedStarter = Callable[[Any, "asyncio.Future[Any]", Callable[[BaseException | None], None]], None]
# A "now" starter queues one job from the calling thread (no loop involved): ``starter(job, done)``;
# ``done(error)`` runs in whichever thread learns that the job has landed or failed (the proxy engine's
# reports: the scheduler's own thread, holding the cache's state lock).
NowStarter = Callable[[Any, Callable[[BaseException | None], None]], None]


@dataclass
class CopyJob:
    """GPU <-> CPU: row ``src_ids[i]`` of the source into row ``dst_ids[i]`` of the destination.

    ``compute``: what the copy is ordered after (a recorded CUDA event, or None; see
    ``transfer.base.check_compute``).
    """

    src_ids: np.ndarray
    dst_ids: np.ndarray
    compute: Any = None

    def __len__(self) -> int:
        return len(self.src_ids)


class Dispatcher:
    """Runs jobs through the handler registered for their (src, dst) media, under one byte budget."""

    def __init__(self, budget: ByteBudget, metrics: CacheMetrics, bytes_per_block: int) -> None:
        self._budget = budget
        self._metrics = metrics
        self._bpb = bytes_per_block
        self._handlers: dict[tuple[str, str], Handler] = {}
        self._inline: dict[tuple[str, str], InlineHandler] = {}
        self._threaded: dict[tuple[str, str], ThreadedStarter] = {}
        self._now: dict[tuple[str, str], NowStarter] = {}

    def register(self, src: str, dst: str, handler: Handler) -> None:
        if src not in MEDIA or dst not in MEDIA or src == dst:
            raise TransferError(f"cannot register a handler for {src!r} -> {dst!r}; media are {MEDIA}")
        self._handlers[(src, dst)] = handler

    def register_inline(self, src: str, dst: str, handler: InlineHandler) -> None:
        if (src, dst) not in DIRECTIONS:
            raise TransferError(f"cannot register an inline handler for {src!r} -> {dst!r}")
        self._inline[(src, dst)] = handler

    def run_inline(self, src: str, dst: str, job: Any) -> bool:
        """Run ``job`` now, on this thread, when an inline handler takes it and the budget admits it
        at once (its bytes are in flight only within this call); False, having done nothing, otherwise."""
        handler = self._inline.get((src, dst))
        n = len(job)
        if handler is None or not self._budget.admits_now(n * self._bpb):
            return False
        t0 = time.perf_counter()
        if not handler(job):
            return False
        self._metrics.moved(DIRECTIONS[(src, dst)], n, n * self._bpb, time.perf_counter() - t0)
        return True

    def register_threaded(self, src: str, dst: str, starter: ThreadedStarter) -> None:
        if (src, dst) not in DIRECTIONS:
            raise TransferError(f"cannot register a threaded starter for {src!r} -> {dst!r}")
        self._threaded[(src, dst)] = starter

    def start_threaded(
        self,
        src: str,
        dst: str,
        job: Any,
        token: asyncio.Future,
        done: Callable[[BaseException | None], None],
    ) -> bool:
        """Start ``job`` on the engine's thread when a starter is registered and the budget admits it at
        once; ``done(error)`` runs on the loop once it has landed (the budget is released first).
        False, having done nothing, otherwise: the job must go through ``run``."""
        starter = self._threaded.get((src, dst))
        if starter is None:
            return False
        return self._start(src, dst, job, lambda landed: starter(job, token, landed), done)

    def register_now(self, src: str, dst: str, starter: NowStarter) -> None:
        if (src, dst) not in DIRECTIONS:
            raise TransferError(f"cannot register a now starter for {src!r} -> {dst!r}")
        self._now[(src, dst)] = starter

    def start_now(self, src: str, dst: str, job: Any, done: Callable[[BaseException | None], None]) -> bool:
        """Queue ``job`` from this thread when a now starter is registered and the budget admits it at once
        (a try-take: never waits); ``done(error)`` runs once it has landed (the budget is released first).
        False, having done nothing, otherwise."""
        starter = self._now.get((src, dst))
        if starter is None:
            return False
        return self._start(src, dst, job, lambda landed: starter(job, landed), done)

    def _start(self, src: str, dst: str, job: Any, start: Callable[[Callable[[BaseException | None], None]], None],
               done: Callable[[BaseException | None], None]) -> bool:  # fmt: skip
        n = len(job)
        nbytes = n * self._bpb
        if not self._budget.take_now(nbytes):
            return False
        self._metrics.inflight_bytes.set(self._budget.used)
        t0 = time.perf_counter()

        def landed(error: BaseException | None) -> None:
            self._budget.release(nbytes)
            self._metrics.inflight_bytes.set(self._budget.used)
            if error is None:
                self._metrics.moved(DIRECTIONS[(src, dst)], n, nbytes, time.perf_counter() - t0)
            done(error)

        try:
            start(landed)
        except BaseException:
            self._budget.release(nbytes)
            self._metrics.inflight_bytes.set(self._budget.used)
            raise
        return True

    def handles(self, src: str, dst: str) -> bool:
        return (src, dst) in self._handlers

    async def run(self, src: str, dst: str, job: Any) -> np.ndarray:
        """Run ``job`` (its ``len`` is its block count); returns the per-block ok mask."""
        n = len(job)
        if n == 0:
            return np.zeros(0, dtype=bool)
        handler = self._handlers.get((src, dst))
        if handler is None:
            raise TransferError(f"no handler registered for {src} -> {dst}")
        nbytes = n * self._bpb
        await self._budget.acquire(nbytes)
        self._metrics.inflight_bytes.set(self._budget.used)
        t0 = time.perf_counter()  # not loop.time(): uvloop's ticks in whole milliseconds
        try:
            ok = await handler(job)
        finally:
            self._budget.release(nbytes)
            self._metrics.inflight_bytes.set(self._budget.used)
        done = int(np.count_nonzero(ok))
        self._metrics.moved(DIRECTIONS[(src, dst)], done, done * self._bpb, time.perf_counter() - t0)
        return ok
