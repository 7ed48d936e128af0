"""The cache's moves: a store's or a load's plan executed by the mover, and committed.

A mixin of TieredKVCache (cache.py keeps the public API, lifecycle and control
path): each body plans with the manager (reserve), runs the plan's jobs in order
(spills of evicted slots, promotions from disk or the remote tier, the GPU copy),
and commits or aborts once every copy of the plan has landed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DiskError
from .manager import LoadPlan, SpillJob, StorePlan
from .mover import CopyJob

log = logging.getLogger(__name__)
INLINE_COPY_BYTES = 1 << 20  # host copies up to this size run on the loop: a thread hand-off costs more


@dataclass(frozen=True)
class StoreResult:
    stored: int = 0  # copied into new CPU slots
    deduped: int = 0  # already resident (or repeated in the call): touched, not copied
    in_flight: int = 0  # another store or promotion of the key is still in flight
    skipped: int = 0  # did not fit (the trailing new keys), or the call was cancelled


class _Op:
    __slots__ = ("cancelled", "idle", "before_copy", "hold", "base", "compute")

    def __init__(self) -> None:
        self.cancelled = False
        self.idle = False  # True while the move holds nothing and issued no copy: safe to cancel outright
        self.before_copy: Callable[[], Awaitable[Any]] | None = None  # a load's hook, run once
        self.hold: Any = None  # an exclusive load's pins on its run (manager.loading.RunHold)
        self.base = 0  # position in the load's keys of the chunk being planned
        self.compute: Any = None  # the caller's compute event: every GPU copy of the move waits on it


class _Call(asyncio.Future):
    """The one future of a call whose copy runs on the engine's thread, resolved (on the loop) once the
    copy has landed and the plan is committed. A caller's cancel cannot cancel it: it marks the call
    given up (a store then discards what it copied: the caller may reuse its GPU blocks at once), and
    the caller's task gets CancelledError only once the copy has landed, as the contract says."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.gave_up = False

    def cancel(self, msg: Any = None) -> bool:
        self.gave_up = True
        return False


class Moves:
    """Store and load bodies (see the module docstring); the facade supplies the state."""

    def _own(self, call: _Call) -> _Call:
        """aclose waits for the call as for a task the cache owns."""
        self._tasks.add(call)
        call.add_done_callback(self._task_done)
        return call

    async def _store_after(self, op: _Op, after: Awaitable[Any], keys: list[bytes], ids: np.ndarray,
                           prefix: list[bytes]) -> StoreResult:  # fmt: skip
        op.idle = True  # nothing reserved yet: a cancel may stop it outright
        try:
            await after
        finally:
            op.idle = False
            self.manager.withdraw(keys)  # the plan below takes over (same step): still in flight
            self._progressed()
        return await self._store_body(op, keys, ids, prefix)

    async def _wait_progress(self, op: _Op) -> None:
        """Wait until some plan completes (room freed, an in-flight key landed); cancel-safe."""
        if self._progress is None or self._progress.done():
            self._progress = asyncio.get_running_loop().create_future()
        op.idle = True
        try:
            await asyncio.shield(self._progress)
        finally:
            op.idle = False

    def _progressed(self) -> None:
        if self._progress is not None and not self._progress.done():
            self._progress.set_result(None)

    # -- store --------------------------------------------------------------------------
    def _store_now(self, keys: list[bytes], ids: np.ndarray,
                   prefix: list[bytes]) -> tuple[StoreResult | _Call | None, StorePlan]:  # fmt: skip
        """Plan; when nothing must wait but the copy (no spill, no room to wait for), copy and commit
        at once if the copy runs inline, with no suspension point: (result, plan); or start it on the
        engine's thread: (its call, plan). Else (None, plan) for ``_store_body``, which executes the plan."""
        m = self.manager
        plan = m.prepare_store(keys, ids, prefix)
        if plan.spill is not None or plan.remote_spill is not None:
            return None, plan
        if plan.unplaced and not len(plan.cpu_slots) and (m.cpu.n_reserved or m.cpu.n_ready_pinned):
            return None, plan  # room may come free: the body waits for it
        if len(plan.cpu_slots):
            job = CopyJob(plan.gpu_ids, plan.cpu_slots)
            try:
                if not self.mover.run_inline("gpu", "cpu", job):
                    return self._threaded_store(len(keys), plan, job), plan
            except BaseException:
                self._finish_store(plan, False)
                raise
        stored = self._finish_store(plan, True)
        return self._store_result(len(keys), stored, plan.deduped, plan.in_flight), plan

    def _threaded_store(self, n_keys: int, plan: StorePlan, job: CopyJob) -> _Call | None:
        call = _Call(asyncio.get_running_loop())

        def landed(error: BaseException | None) -> None:
            try:
                stored = self._finish_store(plan, error is None and not call.gave_up)
            except BaseException as exc:
                call.set_exception(exc)
                return
            if error is not None:
                call.set_exception(error)
            else:
                call.set_result(self._store_result(n_keys, stored, plan.deduped, plan.in_flight))

        return self._own(call) if self.mover.start_threaded("gpu", "cpu", job, call, landed) else None

    def _store_result(self, n: int, stored: int, deduped: int, in_flight: int) -> StoreResult:
        skipped = n - stored - deduped - in_flight
        if skipped:
            self.metrics.skipped.inc(skipped)
        return StoreResult(stored, deduped, in_flight, skipped)

    async def _store_body(self, op: _Op, keys: list[bytes], ids: np.ndarray, prefix: list[bytes],
                          plan: StorePlan | None = None) -> StoreResult:  # fmt: skip
        """Execute ``plan`` (made by ``_store_now``; planned here when None), then place what found no room."""
        m = self.manager
        stored = deduped = in_flight = 0
        todo_keys, todo_ids = keys, ids
        while True:
            if plan is None:
                plan = m.prepare_store(todo_keys, todo_ids, prefix)
            deduped, in_flight = deduped + plan.deduped, in_flight + plan.in_flight
            stored += await self._execute_store(op, plan)
            # Keys that found no slot after every evictable block was taken stay out: evicting
            # this call's own blocks for them would cut the prefix's head. Only when nothing was
            # placed (the tier is full of blocks other calls hold: pins, reservations) wait for
            # one of those calls to finish, then place the rest.
            if not plan.unplaced or op.cancelled or len(plan.cpu_slots):
                break
            if m.cpu.n_reserved == 0 and m.cpu.n_ready_pinned == 0:
                break  # nothing will ever free room
            await self._wait_progress(op)
            rest = plan.unplaced_idx
            prefix = prefix + todo_keys[: int(rest[0])] if len(rest) else prefix
            todo_keys, todo_ids = [todo_keys[i] for i in rest.tolist()], todo_ids[rest]
            plan = None
        return self._store_result(len(keys), stored, deduped, in_flight)

    async def _execute_store(self, op: _Op, plan: StorePlan) -> int:
        ok = False
        try:
            await self._spill_victims(plan.spill, plan.remote_spill)  # the reused slots' old blocks first
            if len(plan.cpu_slots) and not op.cancelled:
                await self.mover.run("gpu", "cpu", CopyJob(plan.gpu_ids, plan.cpu_slots, op.compute))
            # A caller that gave up may already reuse its GPU blocks: what we copied
            # then cannot be trusted to match the keys. Discard it. A call with nothing
            # to copy still commits: its resident keys are touched.
            ok = not op.cancelled
        finally:
            stored = self._finish_store(plan, ok)
        return stored

    def _finish_store(self, plan: StorePlan, ok: bool) -> int:
        """Commit (or abort) a plan whose copy has ended; start its write-through jobs. How many were stored."""
        m = self.manager
        try:
            write_through = m.complete_store(plan, ok)
            remote_job = m.remote_write_job(plan) if ok and self.remote is not None else None
        finally:
            self._progressed()
        if write_through is not None:
            self.spawn(self._spill(write_through), background=True)
        if remote_job is not None:
            self.spawn(self._write_remote(remote_job), background=True)
        return len(plan.cpu_slots) if ok else 0

    async def _spill_victims(self, spill: SpillJob | None, remote_spill: SpillJob | None) -> None:
        """Write-back of evicted slots, to disk and the remote tier at once, before the slots are reused."""
        writes = []
        if spill is not None:
            writes.append(self._spill(spill))
        if remote_spill is not None:
            writes.append(self._write_remote(remote_spill))
        if writes:
            await asyncio.gather(*writes)

    async def _write_remote(self, job: SpillJob) -> None:
        """CPU -> remote; never raises for Redis faults (the store degrades and answers False)."""
        try:
            await self.mover.run("cpu", "remote", job)
        finally:
            self.manager.complete_remote_write(job)
            self._progressed()  # its pins are released: a load waiting for room may go on

    async def _spill(self, job: SpillJob) -> None:
        """CPU -> disk; the manager commits what was written. Never raises for disk faults."""
        disk = self.disk
        try:
            ok = await self.mover.run("cpu", "disk", job) if disk is not None and disk.writable else None
        except DiskError as exc:
            disk.degrade(exc)
            ok = None
        finally:
            if ok is None:
                ok = np.zeros(len(job), dtype=bool)
                self.metrics.drop("cpu", "spill_failed", len(job))
            self.manager.complete_spill(job, ok)
            self.metrics.spills.inc(int(np.count_nonzero(ok)))
            self._progressed()

    # -- load ---------------------------------------------------------------------------
    def _load_now(self, keys: list[bytes], ids: np.ndarray,
                  exclusive: bool) -> tuple[int | _Call | None, LoadPlan | None]:  # fmt: skip
        """Plan; when nothing must wait but the copy (CPU hits only, the run ends in this chunk), copy
        and complete at once if the copy runs inline, with no suspension point: (loaded, plan); or start
        it on the engine's thread: (its call, plan). Else (None, plan) for ``_load_body``; (None, None)
        for an exclusive load through staging."""
        m = self.manager
        if exclusive and m.staging is not None:
            return None, None
        plan = m.prepare_load(keys, self._max_promote, exclusive=exclusive)
        if plan.promote is not None or plan.fetch is not None or plan.spill is not None or plan.restage is not None:
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
            if not self.mover.run_inline("cpu", "gpu", job):
                return self._threaded_load(plan, job), plan
        except BaseException:
            m.complete_load(plan, 0)
            self._progressed()
            raise
        m.complete_load(plan, n)
        self._progressed()
        return n, plan

    def _threaded_load(self, plan: LoadPlan, job: CopyJob) -> _Call | None:
        call = _Call(asyncio.get_running_loop())

        def landed(error: BaseException | None) -> None:
            n = len(job) if error is None else 0
            try:
                self.manager.complete_load(plan, n)
            except BaseException as exc:
                call.set_exception(exc)
                return
            finally:
                self._progressed()
            call.set_exception(error) if error is not None else call.set_result(n)

        return self._own(call) if self.mover.start_threaded("cpu", "gpu", job, call, landed) else None

    async def _load_body(self, op: _Op, keys: list[bytes], ids: np.ndarray, exclusive: bool,
                         plan: LoadPlan | None = None) -> int:  # fmt: skip
        """Load chunk by chunk, from ``plan`` (made by ``_load_now``; planned here when None)."""
        m = self.manager
        if exclusive and m.staging is not None:
            op.hold = m.hold_run(keys)
        try:
            return await self._load_chunks(op, keys, ids, exclusive, plan)
        finally:
            if op.hold is not None:
                m.release_hold(op.hold, len(keys))
                op.hold = None
                self._progressed()

    async def _load_chunks(self, op: _Op, keys: list[bytes], ids: np.ndarray, exclusive: bool,
                           first: LoadPlan | None) -> int:  # fmt: skip
        m = self.manager
        loaded = 0
        # A plan made before the task started holds pins: it runs (and completes) even if cancelled.
        while first is not None or (loaded < len(keys) and not op.cancelled):
            op.base = loaded
            plan, first = first or m.prepare_load(keys[loaded:], self._max_promote, exclusive=exclusive), None
            if not len(plan):
                if op.cancelled:
                    break
                if plan.stop == "in_flight" or (
                    plan.stop == "room" and (m.cpu.n_reserved or m.cpu.n_ready_pinned or m.staging_in_use)
                ):
                    # Another call is storing or promoting it (or holds the room): wait, then go on.
                    # The hook runs first (what we wait for may be a store it lets in), then plan again.
                    if op.before_copy is not None:
                        await self._before_copy(op)
                        continue
                    if op.hold is not None:  # never wait while holding room another call may need
                        m.release_hold(op.hold, len(keys))
                        op.hold = None
                        continue
                    await self._wait_progress(op)
                    continue
                break
            n = await self._execute_load(op, plan, ids[loaded:])
            loaded += n
            if n < len(plan) or plan.stop in ("", "miss"):
                break
        if not op.cancelled:
            await self._before_copy(op)  # nothing was copied: the hook still runs once
        return loaded

    async def _execute_load(self, op: _Op, plan: LoadPlan, ids: np.ndarray) -> int:
        m = self.manager
        n = 0
        promoted = False
        try:
            await self._spill_victims(plan.spill, plan.remote_spill)
            n = len(plan)
            if plan.promote is not None or plan.fetch is not None:
                got = await asyncio.gather(self._promote(plan), self._fetch(plan))
                promoted = True
                if plan.promote is not None:
                    ok = got[0]
                    if ok is None:  # the read failed as a whole: a miss, but the disk copies may be fine
                        n = m.complete_promote(plan, np.zeros(len(plan.promote), dtype=bool), corrupt=False)
                    else:
                        n = m.complete_promote(plan, ok)
                if plan.fetch is not None:
                    n = min(n, m.complete_fetch(plan, got[1]))
                self._progressed()
                if self.disk is not None:
                    dropped = m.take_disk_invalidations()
                    if dropped is not None:
                        self.disk.invalidate(dropped)
            if plan.restage is not None:
                await self._restage(plan)
            if op.hold is not None:  # this chunk's blocks moved up: the room they leave is free now
                m.release_hold(op.hold, op.base + len(plan))
            await self._before_copy(op)
            if n and not op.cancelled:
                await self.mover.run("cpu", "gpu", CopyJob(plan.cpu_slots[:n], ids[:n], op.compute))
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
            self._progressed()
        return n

    async def _restage(self, plan: LoadPlan) -> None:
        """Copy an exclusive load's CPU hits into their staging rows, then let their CPU slots go."""
        src, dst = plan.restage
        slab = self.slabs.slab_np

        def copy() -> None:
            slab[dst] = slab[src]

        if len(src) * self.layout.bytes_per_block <= INLINE_COPY_BYTES:
            copy()
        else:
            await asyncio.get_running_loop().run_in_executor(None, copy)
        self.manager.complete_restage(plan)

    @staticmethod
    async def _before_copy(op: _Op) -> None:
        hook, op.before_copy = op.before_copy, None
        if hook is not None:
            await hook()

    async def _fetch(self, plan: LoadPlan) -> np.ndarray | None:
        """Remote -> CPU: per-block arrived-and-verified mask (a gone or bad block is a miss)."""
        if plan.fetch is None:
            return None
        return await self.mover.run("remote", "cpu", plan.fetch)

    async def _promote(self, plan: LoadPlan) -> np.ndarray | None:
        """Per-block verification result, or None when the read failed as a whole."""
        if plan.promote is None:
            return None
        try:
            return await self.mover.run("disk", "cpu", plan.promote)
        except DiskError as exc:
            log.warning("disk tier: a promotion of %d blocks failed (%s); treating them as misses",
                        len(plan.promote), exc)  # fmt: skip
            return None
