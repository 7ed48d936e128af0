"""The store runner: a store's plan executed (spills of the slots it reuses, then the GPU -> CPU copy) and finished.

Plan (the manager's ``prepare_store``) -> execute (here, through the dispatcher) -> finish (the
manager's ``complete_store``), then the write-through jobs start in the background (spill.py).
When nothing must wait but the copy and the engine copies inline (host engines, small batches),
``store`` copies and commits within the call, with no suspension point, so no cancellation can
come between; a larger host copy goes to the engine's thread with one hand-off
(ThreadedCopyFuture). Otherwise the plan runs as a task the cache owns (``run_move``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...manager import StorePlan, TierManager
from ...metrics import CacheMetrics
from ...owned_tasks import TaskSet
from ..handlers import CopyJob, Dispatcher
from .control import MoveControl, Progress, ThreadedCopyFuture, run_move
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
        if after is None:
            result, plan = self._store_now(keys, ids, prefix)
            if result is None:
                control = MoveControl(compute)
                return await run_move(self._tasks, control, self._run(control, keys, ids, prefix, plan))
            if not isinstance(result, StoreResult):
                result = await result  # the copy on the engine's thread (a cancel waits for it to land)
            return result
        self._m.announce(keys)
        control = MoveControl(compute)
        return await run_move(self._tasks, control, self._run_after(control, after, keys, ids, prefix))

    def store_sync(
        self, keys: list[bytes], ids: np.ndarray, prefix: list[bytes]
    ) -> tuple[concurrent.futures.Future | None, Coroutine[Any, Any, StoreResult] | None]:
        """Plan a store in the caller's thread (the cache's state lock held, its loop parked): when nothing
        must wait, commit it (nothing to copy) or queue its copy through the dispatcher's ``start_now``:
        (outcome, None). Else (None, rest): ``rest`` executes the plan on the loop (spills, room to wait
        for, the byte budget), its copy queued whenever it gets there: still correct for a store."""
        m = self._m
        plan = m.prepare_store(keys, ids, prefix)
        out: concurrent.futures.Future = concurrent.futures.Future()
        waits = plan.spill is not None or plan.remote_spill is not None
        if not waits and plan.unplaced and not len(plan.cpu_slots) and (m.cpu.n_reserved or m.cpu.n_ready_pinned):
            waits = True  # room may come free: the run waits for it
        if not waits and len(plan.cpu_slots):

            def landed(error: BaseException | None) -> None:
                try:
                    stored = self._finish(plan, error is None)
                except BaseException as exc:
                    out.set_exception(exc)
                    return
                if error is not None:
                    out.set_exception(error)
                else:
                    out.set_result(self._result(len(keys), stored, plan.deduped, plan.in_flight))

            try:
                waits = not self._dispatch.start_now("gpu", "cpu", CopyJob(plan.gpu_ids, plan.cpu_slots), landed)
            except BaseException:
                self._finish(plan, False)
                raise
            if not waits:
                return out, None
        if waits:
            control = MoveControl()
            return None, run_move(self._tasks, control, self._run(control, keys, ids, prefix, plan))
        stored = self._finish(plan, True)
        out.set_result(self._result(len(keys), stored, plan.deduped, plan.in_flight))
        return out, None

    def _store_now(
        self, keys: list[bytes], ids: np.ndarray, prefix: list[bytes]
    ) -> tuple[StoreResult | ThreadedCopyFuture | None, StorePlan]:
        """Plan; when nothing must wait but the copy (no spill, no room to wait for), copy and commit
        at once if the copy runs inline, with no suspension point: (result, plan); or start it on the
        engine's thread: (its future, plan). Else (None, plan) for ``_run``, which executes the plan."""
        m = self._m
        plan = m.prepare_store(keys, ids, prefix)
        if plan.spill is not None or plan.remote_spill is not None:
            return None, plan
        if plan.unplaced and not len(plan.cpu_slots) and (m.cpu.n_reserved or m.cpu.n_ready_pinned):
            return None, plan  # room may come free: the run waits for it
        if len(plan.cpu_slots):
            job = CopyJob(plan.gpu_ids, plan.cpu_slots)
            try:
                if not self._dispatch.run_inline("gpu", "cpu", job):
                    return self._threaded(len(keys), plan, job), plan
            except BaseException:
                self._finish(plan, False)
                raise
        stored = self._finish(plan, True)
        return self._result(len(keys), stored, plan.deduped, plan.in_flight), plan

    def _threaded(self, n_keys: int, plan: StorePlan, job: CopyJob) -> ThreadedCopyFuture | None:
        call = ThreadedCopyFuture(asyncio.get_running_loop())

        def landed(error: BaseException | None) -> None:
            try:
                stored = self._finish(plan, error is None and not call.gave_up)
            except BaseException as exc:
                call.set_exception(exc)
                return
            if error is not None:
                call.set_exception(error)
            else:
                call.set_result(self._result(n_keys, stored, plan.deduped, plan.in_flight))

        return (
            self._tasks.own(call) if self._dispatch.start_threaded("gpu", "cpu", job, call, landed) else None
        )

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
        """Execute ``plan`` (made by ``_store_now``; planned here when None), then place what found no room."""
        m = self._m
        stored = deduped = in_flight = 0
        todo_keys, todo_ids = keys, ids
        while True:
            if plan is None:
                plan = m.prepare_store(todo_keys, todo_ids, prefix)
            deduped, in_flight = deduped + plan.deduped, in_flight + plan.in_flight
            stored += await self._execute(control, plan)
            # Keys that found no slot after every evictable block was taken stay out: evicting
            # this call's own blocks for them would cut the prefix's head. Only when nothing was
            # placed (the tier is full of blocks other calls hold: pins, reservations) wait for
            # one of those calls to finish, then place the rest.
            if not plan.unplaced or control.cancelled or len(plan.cpu_slots):
                break
            if m.cpu.n_reserved == 0 and m.cpu.n_ready_pinned == 0:
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
                await self._dispatch.run("gpu", "cpu", CopyJob(plan.gpu_ids, plan.cpu_slots, control.compute))
            # A caller that gave up may already reuse its GPU blocks: what we copied
            # then cannot be trusted to match the keys. Discard it. A call with nothing
            # to copy still commits: its resident keys are touched.
            ok = not control.cancelled
        finally:
            stored = self._finish(plan, ok)
        return stored

    def _finish(self, plan: StorePlan, ok: bool) -> int:
        """Commit (or abort) a plan whose copy has ended; start its write-through jobs. How many were stored."""
        m = self._m
        self._metrics.store_slots(plan.cpu_slots)
        try:
            write_through = m.complete_store(plan, ok)
            remote_job = m.remote_write_job(plan) if ok and self._remote_writes else None
        finally:
            self._progress.notify()
        self._spills.in_background(write_through, remote_job)
        return len(plan.cpu_slots) if ok else 0
