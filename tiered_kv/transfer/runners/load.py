"""The load runner: a load's plans executed chunk by chunk (promotions from disk and Redis, then the
CPU -> GPU copy) and finished by the load planner.

Plan (the load planner's ``prepare``) -> execute (here: spills of the CPU slots the promotions
reuse, the reads into those slots, an exclusive load's restaging, the copy into the caller's GPU
blocks, each through the dispatcher) -> finish (``complete_promote`` / ``complete_fetch``, then
``complete_load``). A prefix longer than one chunk is planned again where the last chunk stopped; a
key in flight elsewhere is waited for (``Progress``). One body starts a plan's copy now
(``_load_nowait``: CPU hits alone, started inline, on the engine's thread, queue or stream) or raises
WouldBlock; ``load`` (on the loop) and ``load_sync`` (in a thread holding the cache's state lock)
are doors over it.
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
from ...media import CPU_TO_DISK, CPU_TO_GPU, RESTAGE
from ...owned_tasks import TaskSet
from ..handlers import CopyJob, Dispatcher, WouldBlock
from .control import MoveControl, Outcome, Progress, run_move
from .spill import SpillRunner

log = logging.getLogger(__name__)


class LoadRunner:
    """Executes load plans (see the module docstring); ``max_promote``: blocks promoted per chunk."""

    def __init__(
        self,
        manager: TierManager,
        dispatcher: Dispatcher,
        spills: SpillRunner,
        tasks: TaskSet,
        progress: Progress,
        *,
        max_promote: int,
    ) -> None:
        self._m = manager
        self._plans = manager.loads
        self._dispatch = dispatcher
        self._spills = spills
        self._tasks = tasks
        self._progress = progress
        self._max_promote = max_promote

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
        if before_copy is None and not (exclusive and self._m.staging is not None):  # else: through staging
            plan = self._m.prepare_load(keys, self._max_promote, exclusive=exclusive)
            n = len(plan)
            # Only a run that ends in this chunk starts now; one that waits for others' keys or room plans again.
            if not plan.must_wait and (n and plan.stop in ("", "miss") or not n and not self._others_hold(plan)):
                try:
                    got = self._load_nowait(plan, ids, Outcome(asyncio.get_running_loop()), compute)
                except WouldBlock:
                    pass
                else:  # an int, or the copy on the engine's thread (a cancel waits for it to land)
                    return got if isinstance(got, int) else await self._tasks.own(got)
        control = MoveControl(compute)
        control.before_copy = before_copy
        return await run_move(self._tasks, control, self._run(control, keys, ids, exclusive, plan))

    def load_sync(
        self, keys: list[bytes], ids: np.ndarray
    ) -> tuple[concurrent.futures.Future | None, Coroutine[Any, Any, int] | None, int]:
        """Plan a load in the caller's thread (the cache's state lock held, its loop parked) and queue
        its copy at once (loop-free): (outcome, None, blocks planned), the outcome resolved with the
        blocks landed once the copy's engine reports it. (None, None, 0): nothing could start now (no
        CPU hit left, the byte budget held); nothing is held. (None, rest, 0): the plan must wait for
        I/O (a promotion, a spill): ``rest`` runs it on the loop, copying nothing into the GPU blocks."""
        plan = self._m.prepare_load(keys, self._max_promote, exclusive=False)
        if plan.must_wait:
            control = MoveControl()
            control.cancelled = True  # the caller gave up on it: only its reads and spills run
            return None, run_move(self._tasks, control, self._run(control, keys, ids, False, plan)), 0
        if not len(plan):
            return None, None, 0
        out = Outcome()
        try:
            got = self._load_nowait(plan, ids, out)
        except WouldBlock:
            self._complete(plan, 0)
            return None, None, 0
        if isinstance(got, int):
            out().set_result(got)
        return out(), None, len(plan)

    def _load_nowait(self, plan: LoadPlan, ids: np.ndarray, out: Outcome, compute: Any = None) -> int | Any:
        """Start the copy of ``plan``'s CPU hits (nothing for it to wait for) into ``ids``: the blocks
        loaded when it completes within the call (an inline copy, or nothing to copy); ``out``'s future
        when the copy was handed off (resolved with the blocks landed once it has, the plan completed first).
        WouldBlock, the plan untouched, when the dispatcher cannot start it at once."""
        n = len(plan)
        if not n:
            return 0
        job = CopyJob(CPU_TO_GPU, plan.cpu_slots, ids[:n], compute)

        def landed(error: BaseException | None) -> None:
            fut = out()
            try:
                self._complete(plan, n if error is None else 0)
            except BaseException as exc:
                fut.set_exception(exc)
                return
            fut.set_exception(error) if error is not None else fut.set_result(n)

        try:
            if not self._dispatch.start_nowait(job, landed, out):
                return out()
        except WouldBlock:
            raise
        except BaseException:
            self._complete(plan, 0)
            raise
        self._complete(plan, n)
        return n

    def _complete(self, plan: LoadPlan, loaded: int) -> None:
        try:
            self._m.complete_load(plan, loaded)
        finally:
            self._progress.notify()

    def _others_hold(self, plan: LoadPlan) -> bool:
        """An empty chunk that another call may unblock: a key it is storing or promoting, or room it holds."""
        return plan.stop == "in_flight" or (plan.stop == "room" and self._m.state.room_may_free(staging=True))

    async def promote(self, keys: list[bytes]) -> int:
        """The load's chunks without the GPU copy: the leading run's disk and Redis blocks are read into CPU
        slots (TieredKVCache.promote). Returns the blocks of the run that were in the CPU tier once each landed."""
        control = MoveControl()
        return await run_move(self._tasks, control, self._run(control, keys, None, False, None))

    async def _run(
        self,
        control: MoveControl,
        keys: list[bytes],
        ids: np.ndarray | None,
        exclusive: bool,
        plan: LoadPlan | None,
    ) -> int:
        """Load chunk by chunk, from ``plan`` (made by a door; planned here when None); ``ids`` None:
        promote only (no GPU copy)."""
        if exclusive and self._m.staging is not None:
            control.hold = self._plans.hold_run(keys)
        try:
            return await self._chunks(control, keys, ids, exclusive, plan)
        finally:
            if control.hold is not None:
                self._plans.release_hold(control.hold, len(keys))
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
        loaded = 0
        # A plan made before the task started holds pins: it runs (and completes) even if cancelled.
        while first is not None or (loaded < len(keys) and not control.cancelled):
            control.base = loaded
            plan, first = first or self._m.prepare_load(keys[loaded:], self._max_promote, exclusive=exclusive), None
            if not len(plan):
                if control.cancelled:
                    break
                if self._others_hold(plan):
                    # Another call is storing or promoting it (or holds the room): wait, then go on.
                    # The hook runs first (what we wait for may be a store it lets in), then plan again.
                    if control.before_copy is not None:
                        await _before_copy(control)
                        continue
                    if control.hold is not None:  # never wait while holding room another call may need
                        self._plans.release_hold(control.hold, len(keys))
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
        m = self._plans
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
                    await self._dispatch.run(CopyJob(CPU_TO_GPU, plan.cpu_slots[:n], ids[:n], control.compute))
            else:
                n = 0
        except BaseException:
            if (plan.promote is not None or plan.fetch is not None) and not promoted:
                m.abort_load(plan)
            n = 0
            raise
        finally:
            if (plan.promote is None and plan.fetch is None) or promoted:
                self._m.complete_load(plan, n)
            self._progress.notify()
        return n

    def _finish_reads(
        self, plan: LoadPlan, n: int, promoted: np.ndarray | None, fetched: np.ndarray | None
    ) -> int:
        """Commit what the disk and remote reads brought in; the run ends at the first block that did not come."""
        m = self._plans
        if plan.promote is not None:
            if promoted is None:  # the read failed as a whole: a miss, but the disk copies may be fine
                n = m.complete_promote(plan, np.zeros(len(plan.promote), dtype=bool), corrupt=False)
            else:
                n = m.complete_promote(plan, promoted)
        if plan.fetch is not None:
            n = min(n, m.complete_fetch(plan, fetched))
        self._progress.notify()
        dropped = self._m.take_disk_invalidations()
        if dropped is not None:
            self._dispatch.forget(CPU_TO_DISK, dropped)  # the disk store journals them
        return n

    async def _restage(self, plan: LoadPlan) -> None:
        """Copy an exclusive load's CPU hits into their staging rows, then let their CPU slots go."""
        await self._dispatch.run(CopyJob(RESTAGE, *plan.restage))
        self._plans.complete_restage(plan)

    async def _fetch(self, plan: LoadPlan) -> np.ndarray | None:
        """Remote -> CPU: per-block arrived-and-verified mask (a gone or bad block is a miss)."""
        if plan.fetch is None:
            return None
        return await self._dispatch.run(plan.fetch)

    async def _promote(self, plan: LoadPlan) -> np.ndarray | None:
        """Per-block verification result, or None when the read failed as a whole."""
        if plan.promote is None:
            return None
        try:
            return await self._dispatch.run(plan.promote)
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
