"""The store runner: a store's plan executed (spills of the slots it reuses, then the GPU -> CPU copy) and finished.

Plan (the store planner's ``prepare``) -> execute (here, through the dispatcher) -> finish (its
``complete``), then the write-through jobs start in the background (spill.py).
One body decides whether a plan starts now (``_store_nowait``, the shape of ``ByteBudget.take_now``):
nothing must wait but the copy, and the dispatcher starts it at once (inline, with no suspension point,
so no cancellation can come between; or handed to the engine's thread, queue or stream: handlers/
gpu_cpu.py) -> its result or its
future; or it raises WouldBlock and the plan runs as a task the cache owns (``run_move``). ``store``
(on the loop) and ``store_sync`` (in a thread holding the cache's state lock) are doors over it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...manager import StorePlan, TierManager
from ...media import GPU_TO_CPU
from ...metrics import CacheMetrics
from ...owned_tasks import TaskSet
from ..handlers import CopyJob, Dispatcher, WouldBlock
from .control import MoveControl, Outcome, Progress, run_move
from .spill import SpillRunner


@dataclass(frozen=True)
class StoreResult:
    stored: int = 0  # copied into new CPU slots
    deduped: int = 0  # already resident (or repeated in the call): touched, not copied
    in_flight: int = 0  # another store or promotion of the key is still in flight
    skipped: int = 0  # did not fit (the trailing new keys), or the call was cancelled


class StoreRunner:
    """Executes store plans (see the module docstring); ``remote_writes``: a remote tier is open."""

    def __init__(
        self,
        manager: TierManager,
        dispatcher: Dispatcher,
        metrics: CacheMetrics,
        spills: SpillRunner,
        tasks: TaskSet,
        progress: Progress,
        *,
        remote_writes: bool,
    ) -> None:
        self._m = manager
        self._dispatch = dispatcher
        self._metrics = metrics
        self._spills = spills
        self._tasks = tasks
        self._progress = progress
        self._remote_writes = remote_writes

    async def store(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        prefix: list[bytes],
        after: Awaitable[Any] | None,
        compute: Any,
    ) -> StoreResult:
        """Store the keys' GPU blocks (validated by the caller); see TieredKVCache.store."""
        if after is not None:
            self._m.announce(keys)
            control = MoveControl(compute)
            return await run_move(self._tasks, control, self._run_after(control, after, keys, ids, prefix))
        plan = self._m.prepare_store(keys, ids, prefix)
        try:
            got = self._store_nowait(plan, len(keys), Outcome(asyncio.get_running_loop()), compute)
        except WouldBlock:
            control = MoveControl(compute)
            return await run_move(self._tasks, control, self._run(control, keys, ids, prefix, plan))
        if isinstance(got, StoreResult):
            return got
        return await self._tasks.own(got)  # the copy on the engine's thread (a cancel waits for it to land)

    def store_sync(
        self, keys: list[bytes], ids: np.ndarray, prefix: list[bytes]
    ) -> tuple[concurrent.futures.Future | None, Coroutine[Any, Any, StoreResult] | None]:
        """Plan a store in the caller's thread (the cache's state lock held, its loop parked): when it
        starts now, (outcome, None), the outcome resolved once its copy (queued loop-free) has landed and
        the plan is committed. Else (None, rest): ``rest`` executes the plan on the loop (spills, room to
        wait for, the byte budget), its copy queued whenever it gets there: still correct for a store."""
        plan = self._m.prepare_store(keys, ids, prefix)
        out = Outcome()
        try:
            got = self._store_nowait(plan, len(keys), out)
        except WouldBlock:
            control = MoveControl()
            return None, run_move(self._tasks, control, self._run(control, keys, ids, prefix, plan))
        if isinstance(got, StoreResult):
            out().set_result(got)
        return out(), None

    def _store_nowait(self, plan: StorePlan, n_keys: int, out: Outcome, compute: Any = None) -> StoreResult | Any:
        """Start ``plan`` now: its result when it is committed within the call (nothing to copy, or an
        inline copy); ``out``'s future when its copy was handed off (resolved once it lands and the plan
        is committed). WouldBlock, with the plan untouched, when it must wait: its spills first, room
        that may come free, or a copy the dispatcher cannot start at once."""
        if plan.must_wait or (plan.unplaced and not len(plan.cpu_slots) and self._m.state.room_may_free()):
            raise WouldBlock
        if len(plan.cpu_slots):

            def landed(error: BaseException | None) -> None:
                fut = out()
                try:
                    stored = self._finish(plan, error is None and not getattr(fut, "gave_up", False))
                except BaseException as exc:
                    fut.set_exception(exc)
                    return
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(self._result(n_keys, stored, plan.deduped, plan.in_flight))

            try:
                if not self._dispatch.start_nowait(CopyJob(GPU_TO_CPU, plan.gpu_ids, plan.cpu_slots, compute), landed, out):
                    return out()
            except WouldBlock:
                raise
            except BaseException:
                self._finish(plan, False)
                raise
        stored = self._finish(plan, True)
        return self._result(n_keys, stored, plan.deduped, plan.in_flight)

    def _result(self, n: int, stored: int, deduped: int, in_flight: int) -> StoreResult:
        skipped = n - stored - deduped - in_flight
        if skipped:
            self._metrics.skipped.inc(skipped)
        return StoreResult(stored, deduped, in_flight, skipped)

    async def _run_after(
        self,
        control: MoveControl,
        after: Awaitable[Any],
        keys: list[bytes],
        ids: np.ndarray,
        prefix: list[bytes],
    ) -> StoreResult:
        control.idle = True  # nothing reserved yet: a cancel may stop it outright
        try:
            await after
        finally:
            control.idle = False
            self._m.withdraw(keys)  # the plan below takes over (same step): still in flight
            self._progress.notify()
        return await self._run(control, keys, ids, prefix)

    async def _run(
        self,
        control: MoveControl,
        keys: list[bytes],
        ids: np.ndarray,
        prefix: list[bytes],
        plan: StorePlan | None = None,
    ) -> StoreResult:
        """Execute ``plan`` (made by a door; planned here when None), then place what found no room."""
        stored = deduped = in_flight = 0
        todo_keys, todo_ids = keys, ids
        while True:
            if plan is None:
                plan = self._m.prepare_store(todo_keys, todo_ids, prefix)
            deduped, in_flight = deduped + plan.deduped, in_flight + plan.in_flight
            stored += await self._execute(control, plan)
            # Keys that found no slot after every evictable block was taken stay out: evicting
            # this call's own blocks for them would cut the prefix's head. Only when nothing was
            # placed (the tier is full of blocks other calls hold: pins, reservations) wait for
            # one of those calls to finish, then place the rest.
            if not plan.unplaced or control.cancelled or len(plan.cpu_slots):
                break
            if not self._m.state.room_may_free():
                break  # nothing will ever free room
            await self._progress.wait(control)
            rest = plan.unplaced_idx
            prefix = prefix + todo_keys[: int(rest[0])] if len(rest) else prefix
            todo_keys, todo_ids = [todo_keys[i] for i in rest.tolist()], todo_ids[rest]
            plan = None
        return self._result(len(keys), stored, deduped, in_flight)

    async def _execute(self, control: MoveControl, plan: StorePlan) -> int:
        ok = False
        try:
            await self._spills.victims(plan.spill, plan.remote_spill)  # the reused slots' old blocks first
            if len(plan.cpu_slots) and not control.cancelled:
                await self._dispatch.run(CopyJob(GPU_TO_CPU, plan.gpu_ids, plan.cpu_slots, control.compute))
            # A caller that gave up may already reuse its GPU blocks: what we copied
            # then cannot be trusted to match the keys. Discard it. A call with nothing
            # to copy still commits: its resident keys are touched.
            ok = not control.cancelled
        finally:
            stored = self._finish(plan, ok)
        return stored

    def _finish(self, plan: StorePlan, ok: bool) -> int:
        """Commit (or abort) a plan whose copy has ended; start its write-through jobs. How many were stored."""
        self._metrics.store_slots(plan.cpu_slots)
        try:
            write_through = self._m.complete_store(plan, ok)
            remote_job = self._m.room.remote_write_job(plan) if ok and self._remote_writes else None
        finally:
            self._progress.notify()
        self._spills.in_background(write_through, remote_job)
        return len(plan.cpu_slots) if ok else 0
