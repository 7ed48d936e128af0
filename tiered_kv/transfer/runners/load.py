"""The load runner: a load's plans executed chunk by chunk (promotions from disk and Redis, then the
CPU -> GPU copy) and finished by the manager.

Plan (the manager's ``prepare_load``) -> execute (here: spills of the CPU slots the promotions
reuse, the reads into those slots, an exclusive load's restaging, the copy into the caller's GPU
blocks) -> finish (``complete_promote`` / ``complete_fetch``, then ``complete_load``). A prefix
longer than one chunk is planned again where the last chunk stopped; a key in flight elsewhere
is waited for (``Progress``). CPU hits alone, copied inline, load within the call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from ...errors import DiskError
from ...manager import LoadPlan, TierManager
from ...owned_tasks import TaskSet
from ..handlers import CopyJob, DiskIO, Dispatcher
from .control import MoveControl, Progress, ThreadedCopyFuture, run_move
from .spill import SpillRunner

log = logging.getLogger(__name__)
INLINE_COPY_BYTES = 1 << 20  # host copies up to this size run on the loop: a thread hand-off costs more


class LoadRunner:
    """Executes load plans (see the module docstring).

    ``slab``: the CPU slab's numpy view (``CpuSlabs.slab_np``: an exclusive load restages rows in
    it); ``max_promote``: blocks promoted per chunk; ``disk``: the disk tier's I/O, which
    forgets the disk copies the manager dropped for good.
    """

    def __init__(
        self,
        manager: TierManager,
        dispatcher: Dispatcher,
        spills: SpillRunner,
        tasks: TaskSet,
        progress: Progress,
        *,
        slab: np.ndarray,
        bytes_per_block: int,
        max_promote: int,
        disk: DiskIO | None,
    ) -> None:
        self._m = manager
        self._dispatch = dispatcher
        self._spills = spills
        self._tasks = tasks
        self._progress = progress
        self._slab = slab
        self._bpb = bytes_per_block
        self._max_promote = max_promote
        self._disk = disk

    async def load(
        self,
        keys: list[bytes],
        ids: np.ndarray,
        exclusive: bool,
        before_copy: Callable[[], Awaitable[Any]] | None,
        compute: Any,
    ) -> int:
        """Load the leading resident keys into the GPU blocks (validated by the caller); see TieredKVCache.load."""
        plan = None
        if before_copy is None:
            loaded, plan = self._load_now(keys, ids, exclusive)
            if loaded is not None:
                if not isinstance(loaded, int):
                    loaded = await loaded  # the copy on the engine's thread (a cancel waits for it to land)
                return loaded
        control = MoveControl(compute)
        control.before_copy = before_copy
        return await run_move(self._tasks, control, self._run(control, keys, ids, exclusive, plan))

    def load_sync(
        self, keys: list[bytes], ids: np.ndarray
    ) -> tuple[concurrent.futures.Future | None, Coroutine[Any, Any, int] | None, int]:
        """Plan a load in the caller's thread (the cache's state lock held, its loop parked) and queue
        its copy at once through the dispatcher's ``start_now``: (outcome, None, blocks planned), the
        outcome resolved with the blocks landed once the copy's engine reports it. (None, None, 0): nothing
        could start now (no CPU hit left, the byte budget held); nothing is held. (None, rest, 0): the plan
        must wait for I/O (a promotion, a spill): ``rest`` runs it on the loop, copying nothing into the
        GPU blocks."""
        m = self._m
        plan = m.prepare_load(keys, self._max_promote, exclusive=False)
        if any(p is not None for p in (plan.promote, plan.fetch, plan.spill, plan.restage, plan.remote_spill)):
            control = MoveControl()
            control.cancelled = True  # the caller gave up on it: only its reads and spills run
            return None, run_move(self._tasks, control, self._run(control, keys, ids, False, plan)), 0
        n = len(plan)
        if not n:
            return None, None, 0
        out: concurrent.futures.Future = concurrent.futures.Future()

        def landed(error: BaseException | None) -> None:
            try:
                m.complete_load(plan, 0 if error is not None else n)
            finally:
                self._progress.notify()
            out.set_exception(error) if error is not None else out.set_result(n)

        try:
            started = self._dispatch.start_now("cpu", "gpu", CopyJob(plan.cpu_slots, ids[:n]), landed)
        except BaseException:
            m.complete_load(plan, 0)
            self._progress.notify()
            raise
        if not started:
            m.complete_load(plan, 0)
            self._progress.notify()
            return None, None, 0
        return out, None, n

    async def promote(self, keys: list[bytes]) -> int:
        """The load's chunks without the GPU copy: the leading run's disk and Redis blocks are read into CPU
        slots (TieredKVCache.promote). Returns the blocks of the run that were in the CPU tier once each landed."""
        control = MoveControl()
        return await run_move(self._tasks, control, self._run(control, keys, None, False, None))

    def _load_now(
        self, keys: list[bytes], ids: np.ndarray, exclusive: bool
    ) -> tuple[int | ThreadedCopyFuture | None, LoadPlan | None]:
        """Plan; when nothing must wait but the copy (CPU hits only, the run ends in this chunk), copy
        and complete at once if the copy runs inline, with no suspension point: (loaded, plan); or start
        it on the engine's thread: (its future, plan). Else (None, plan) for ``_run``; (None, None)
        for an exclusive load through staging."""
        m = self._m
        if exclusive and m.staging is not None:
            return None, None
        plan = m.prepare_load(keys, self._max_promote, exclusive=exclusive)
        if (
            plan.promote is not None
            or plan.fetch is not None
            or plan.spill is not None
            or plan.restage is not None
        ):
            return None, plan
        if plan.remote_spill is not None:
            return None, plan
        n = len(plan)
        if not n:
            busy = m.cpu.n_reserved or m.cpu.n_ready_pinned or m.staging_in_use
            return (None, plan) if plan.stop == "in_flight" or (plan.stop == "room" and busy) else (0, plan)
        if plan.stop not in ("", "miss"):
            return None, plan  # more chunks follow, and may wait
        job = CopyJob(plan.cpu_slots, ids[:n])
        try:
            if not self._dispatch.run_inline("cpu", "gpu", job):
                return self._threaded(plan, job), plan
        except BaseException:
            m.complete_load(plan, 0)
            self._progress.notify()
            raise
        m.complete_load(plan, n)
        self._progress.notify()
        return n, plan

    def _threaded(self, plan: LoadPlan, job: CopyJob) -> ThreadedCopyFuture | None:
        call = ThreadedCopyFuture(asyncio.get_running_loop())

        def landed(error: BaseException | None) -> None:
            n = len(job) if error is None else 0
            try:
                self._m.complete_load(plan, n)
            except BaseException as exc:
                call.set_exception(exc)
                return
            finally:
                self._progress.notify()
            call.set_exception(error) if error is not None else call.set_result(n)

        return (
            self._tasks.own(call) if self._dispatch.start_threaded("cpu", "gpu", job, call, landed) else None
        )

    async def _run(
        self,
        control: MoveControl,
        keys: list[bytes],
        ids: np.ndarray | None,
        exclusive: bool,
        plan: LoadPlan | None,
    ) -> int:
        """Load chunk by chunk, from ``plan`` (made by ``_load_now``; planned here when None); ``ids`` None:
        promote only (no GPU copy)."""
        m = self._m
        if exclusive and m.staging is not None:
            control.hold = m.hold_run(keys)
        try:
            return await self._chunks(control, keys, ids, exclusive, plan)
        finally:
            if control.hold is not None:
                m.release_hold(control.hold, len(keys))
                control.hold = None
                self._progress.notify()

    async def _chunks(
        self,
        control: MoveControl,
        keys: list[bytes],
        ids: np.ndarray | None,
        exclusive: bool,
        first: LoadPlan | None,
    ) -> int:
        m = self._m
        loaded = 0
        # A plan made before the task started holds pins: it runs (and completes) even if cancelled.
        while first is not None or (loaded < len(keys) and not control.cancelled):
            control.base = loaded
            plan, first = first or m.prepare_load(keys[loaded:], self._max_promote, exclusive=exclusive), None
            if not len(plan):
                if control.cancelled:
                    break
                if plan.stop == "in_flight" or (
                    plan.stop == "room" and (m.cpu.n_reserved or m.cpu.n_ready_pinned or m.staging_in_use)
                ):
                    # Another call is storing or promoting it (or holds the room): wait, then go on.
                    # The hook runs first (what we wait for may be a store it lets in), then plan again.
                    if control.before_copy is not None:
                        await _before_copy(control)
                        continue
                    if control.hold is not None:  # never wait while holding room another call may need
                        m.release_hold(control.hold, len(keys))
                        control.hold = None
                        continue
                    await self._progress.wait(control)
                    continue
                break
            n = await self._execute(control, plan, None if ids is None else ids[loaded:])
            loaded += n
            if n < len(plan) or plan.stop in ("", "miss"):
                break
        if not control.cancelled:
            await _before_copy(control)  # nothing was copied: the hook still runs once
        return loaded

    async def _execute(self, control: MoveControl, plan: LoadPlan, ids: np.ndarray | None) -> int:
        m = self._m
        n = 0
        promoted = False
        try:
            await self._spills.victims(plan.spill, plan.remote_spill)
            n = len(plan)
            if plan.promote is not None or plan.fetch is not None:
                got = await asyncio.gather(self._promote(plan), self._fetch(plan))
                promoted = True
                n = self._finish_reads(plan, n, got[0], got[1])
            if plan.restage is not None:
                await self._restage(plan)
            if control.hold is not None:  # this chunk's blocks moved up: the room they leave is free now
                m.release_hold(control.hold, control.base + len(plan))
            await _before_copy(control)
            if n and not control.cancelled:
                if ids is not None:  # None: a promotion, the run stays in its CPU slots
                    await self._dispatch.run(
                        "cpu", "gpu", CopyJob(plan.cpu_slots[:n], ids[:n], control.compute)
                    )
            else:
                n = 0
        except BaseException:
            if (plan.promote is not None or plan.fetch is not None) and not promoted:
                m.abort_load(plan)
            n = 0
            raise
        finally:
            if (plan.promote is None and plan.fetch is None) or promoted:
                m.complete_load(plan, n)
            self._progress.notify()
        return n

    def _finish_reads(
        self, plan: LoadPlan, n: int, promoted: np.ndarray | None, fetched: np.ndarray | None
    ) -> int:
        """Commit what the disk and remote reads brought in; the run ends at the first block that did not come."""
        m = self._m
        if plan.promote is not None:
            if promoted is None:  # the read failed as a whole: a miss, but the disk copies may be fine
                n = m.complete_promote(plan, np.zeros(len(plan.promote), dtype=bool), corrupt=False)
            else:
                n = m.complete_promote(plan, promoted)
        if plan.fetch is not None:
            n = min(n, m.complete_fetch(plan, fetched))
        self._progress.notify()
        if self._disk is not None:
            dropped = m.take_disk_invalidations()
            if dropped is not None:
                self._disk.invalidate(dropped)
        return n

    async def _restage(self, plan: LoadPlan) -> None:
        """Copy an exclusive load's CPU hits into their staging rows, then let their CPU slots go."""
        src, dst = plan.restage
        slab = self._slab

        def copy() -> None:
            slab[dst] = slab[src]

        if len(src) * self._bpb <= INLINE_COPY_BYTES:
            copy()
        else:
            await asyncio.get_running_loop().run_in_executor(None, copy)
        self._m.complete_restage(plan)

    async def _fetch(self, plan: LoadPlan) -> np.ndarray | None:
        """Remote -> CPU: per-block arrived-and-verified mask (a gone or bad block is a miss)."""
        if plan.fetch is None:
            return None
        return await self._dispatch.run("remote", "cpu", plan.fetch)

    async def _promote(self, plan: LoadPlan) -> np.ndarray | None:
        """Per-block verification result, or None when the read failed as a whole."""
        if plan.promote is None:
            return None
        try:
            return await self._dispatch.run("disk", "cpu", plan.promote)
        except DiskError as exc:
            log.warning(
                "disk tier: a promotion of %d blocks failed (%s); treating them as misses",
                len(plan.promote),
                exc,
            )
            return None


async def _before_copy(control: MoveControl) -> None:
    hook, control.before_copy = control.before_copy, None
    if hook is not None:
        await hook()
