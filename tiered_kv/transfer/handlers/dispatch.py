"""The dispatcher: runs one transfer job through the handler registered for its route (source, destination).

It holds no bookkeeping: the tier manager decides what moves where, the runners (transfer/runners/)
hand each job of a plan here, and the dispatcher runs it under the in-flight byte budget and reports
which blocks made it. Adding a tier adds handlers, not branches: the directions are the registered routes.

Two doors, one budget (the shape of ``ByteBudget``'s ``take_now`` / ``acquire``): ``start_nowait`` starts
a job at once or raises ``WouldBlock`` having done nothing; ``run`` awaits the job's turn and its end.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...byte_budget import ByteBudget
from ...errors import TransferError
from ...media import Medium, Route
from ...metrics import CacheMetrics

Done = Callable[[BaseException | None], None]
# A handler runs one job and returns a per-block ok mask; it raises only for a fault that
# hit the whole batch, and only once nothing of the batch can still be in flight.
Run = Callable[[Any], Awaitable[np.ndarray]]
# An inline copy runs one job on the calling thread: True once it has landed, or False having done
# nothing (it raises as a handler does).
Inline = Callable[[Any], bool]
# A hand-off starts one job without waiting: ``hand_off(job, done, out)``; ``done(error)`` runs once it
# has landed or failed. ``out`` (transfer.runners.control.Outcome) says where the caller waits: on the
# loop (``out.on_loop``: a hand-off to the engine's thread, ``done`` runs on the loop, and ``out()`` is
# the caller's future, in flight until then), or off it (a loop-free queue only: ``done`` runs in
# whichever thread learns the job's end). It raises WouldBlock, having done nothing, when it cannot
# start the job for that caller.
HandOff = Callable[[Any, Done, Any], None]


class WouldBlock(Exception):
    """Nothing was started: the job must go through the awaited door (``Dispatcher.run``)."""


@dataclass(frozen=True)
class Handlers:
    """What one route offers: ``run`` (awaited); started at once (optional), ``inline`` and ``hand_off``;
    for a route into a tier that keeps blocks, ``forget(slots)`` (journal slots dropped for good) and
    ``flush()``."""

    run: Run
    inline: Inline | None = None
    hand_off: HandOff | None = None
    forget: Callable[[np.ndarray], None] | None = None
    flush: Callable[[], Awaitable[Any]] | None = None


@dataclass
class CopyJob:
    """Row ``src_ids[i]`` of ``route.src`` into row ``dst_ids[i]`` of ``route.dst`` (GPU <-> CPU, or rows
    restaged within the CPU slab).

    ``compute``: what the copy is ordered after (a recorded CUDA event, or None; see
    ``transfer.base.check_compute``).
    """

    media: Route
    src_ids: np.ndarray
    dst_ids: np.ndarray
    compute: Any = None

    def __len__(self) -> int:
        return len(self.src_ids)


class Dispatcher:
    """Runs jobs through the handlers registered for their route, under one byte budget."""

    def __init__(self, budget: ByteBudget, metrics: CacheMetrics, bytes_per_block: int) -> None:
        self._budget = budget
        self._metrics = metrics
        self._bpb = bytes_per_block
        # Read at scrape time, not set on every take and release (two gauge writes a call).
        metrics.inflight_bytes.set_function(lambda: budget.used)
        self._routes: dict[str, tuple[Route, Handlers]] = {}  # by the route's name: a str hashes in C

    def register(self, route: Route, run: Run, **more: Any) -> None:
        """``route``'s handlers (``more``: the optional ones of ``Handlers``), replacing any before."""
        if not isinstance(route, Route) or not all(isinstance(m, Medium) for m in (route.src, route.dst)):
            raise TransferError(f"cannot register a handler for {route!r}: a Route of two Media is needed")
        self._routes[route.name] = (route, Handlers(run, **more))

    @property
    def directions(self) -> dict[Route, str]:
        """Each registered route and its metrics label."""
        return {route: name for name, (route, _) in self._routes.items()}

    def handles(self, route: Route) -> bool:
        return route.name in self._routes

    def _handlers(self, route: Route) -> Handlers:
        found = self._routes.get(route.name)
        if found is None:
            raise TransferError(f"no handler registered for {route.src.value} -> {route.dst.value}")
        return found[1]

    def start_nowait(self, job: Any, done: Done, out: Any) -> bool:
        """Start ``job`` at once when the budget admits it now (never waits): True once it has landed
        within the call (an inline copy, for a caller on the loop: its bytes are in flight only within
        the call); False when it was handed off with its bytes taken, and ``done(error)`` runs once it
        has landed (the bytes released first). WouldBlock, having done nothing, otherwise. ``out``: see
        ``HandOff``."""
        handlers = self._handlers(job.media)
        n = len(job)
        nbytes = n * self._bpb
        if not self._budget.admits_now(nbytes):
            raise WouldBlock
        t0 = time.perf_counter()
        if out.on_loop and handlers.inline is not None and handlers.inline(job):
            self._moved(job.media, n, t0)
            return True
        if handlers.hand_off is None:
            raise WouldBlock
        self._budget.take_now(nbytes)  # admitted just above, and nothing ran between

        def landed(error: BaseException | None) -> None:
            self._budget.release(nbytes)
            if error is None:
                self._moved(job.media, n, t0)
            done(error)

        try:
            handlers.hand_off(job, landed, out)
        except BaseException:
            self._budget.release(nbytes)
            raise
        return False

    async def run(self, job: Any) -> np.ndarray:
        """Run ``job`` (its ``len`` is its block count, its ``media`` its route); returns the per-block ok mask."""
        n = len(job)
        if n == 0:
            return np.zeros(0, dtype=bool)
        handler = self._handlers(job.media).run
        nbytes = n * self._bpb
        await self._budget.acquire(nbytes)
        t0 = time.perf_counter()  # not loop.time(): uvloop's ticks in whole milliseconds
        try:
            ok = await handler(job)
        finally:
            self._budget.release(nbytes)
        self._moved(job.media, int(np.count_nonzero(ok)), t0)
        return ok

    def forget(self, route: Route, slots: np.ndarray) -> None:
        """The tier at ``route.dst`` forgets ``slots`` (dropped for good), when it keeps such a journal."""
        forget = self._handlers(route).forget
        if forget is not None and len(slots):
            forget(slots)

    async def flush(self, route: Route) -> None:
        """What ``forget`` journaled for the tier at ``route.dst`` is durable once this returns."""
        flush = self._handlers(route).flush
        if flush is not None:
            await flush()

    def _moved(self, route: Route, done: int, t0: float) -> None:
        if route.moves:  # rows restaged within the CPU slab change no tier
            self._metrics.moved(route.name, done, done * self._bpb, time.perf_counter() - t0)
