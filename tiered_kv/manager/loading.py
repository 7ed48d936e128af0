"""The manager's load planner: plan a load (CPU hits pinned, disk and remote hits promoted into
reserved CPU slots), commit the promotions, release the plan.

One object the manager holds (manager.py), over the tiers of its TierState; it asks the room
finder (spills.py) for CPU slots when the free ones run out.
prepare -> (complete_promote, complete_fetch) -> complete_load | abort_load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..media import REMOTE_TO_CPU
from .key_rows import first_repeat, key_rows
from .plans import LoadPlan, PromoteJob
from .spills import RoomFinder
from .state import TierState
from .tier_index import EMPTY, READY


@dataclass
class RunHold:
    """Pins an exclusive load holds on its run's blocks (positions in its keys), released chunk by chunk."""

    cpu_pos: np.ndarray
    cpu_slots: np.ndarray
    disk_pos: np.ndarray
    disk_slots: np.ndarray


class LoadPlanner:
    """Load plans over the manager's tiers; ``room`` finds CPU slots for promotions."""

    def __init__(self, state: TierState, room: RoomFinder) -> None:
        self._s = state
        self._room = room

    def prepare(self, keys: Sequence[bytes], max_promote: int, *, exclusive: bool = False) -> LoadPlan:
        """Pin the leading run's CPU hits; reserve CPU slots for up to ``max_promote`` disk or remote hits."""
        s = self._s
        if (
            s.fused
            and s.disk is None
            and s.remote_known is None
            and not s.announced
            and len(keys)
            and not (exclusive and s.staging is not None)
        ):
            return self._prepare_cpu(keys, exclusive)
        n = first_repeat(keys)
        if n == 0:
            return LoadPlan(stop="miss" if len(keys) else "")
        rows = key_rows(keys[:n], s.key_bytes)
        cpu_s, cpu_ready, d_s, disk_ready, pending = s.locate(rows)
        d_s = np.where(disk_ready, d_s, -1)
        hit = cpu_ready | disk_ready
        s.mark_announced(keys, hit, pending)
        hit &= ~pending  # announced keys are not loadable yet: the run stops there, in flight
        remote = np.zeros(n, dtype=bool)
        far = np.flatnonzero((cpu_s < 0) & ~hit & ~pending)
        if len(far):
            remote[far] = s.remote_hits(rows[far])
            hit |= remote
        run = int(np.argmin(hit)) if not hit.all() else n
        stop = "" if run == len(keys) else ("in_flight" if run < n and pending[run] else "miss")
        if exclusive and s.staging is not None:
            return self._prepare_staged(rows, cpu_s, cpu_ready, d_s, run, stop, max_promote)
        dpos = np.flatnonzero(~cpu_ready[:run])  # disk and remote hits: each needs a CPU slot
        want = min(len(dpos), max(0, max_promote))
        # This chunk ends before the first hit it cannot promote; only its own CPU hits are
        # pinned (before any eviction below), so hits further on never crowd out its promotions.
        cut = int(dpos[want]) if want < len(dpos) else run
        src = cpu_s[:cut].copy()
        s.cpu.pin(src[cpu_ready[:cut]])
        promote = fetch = spill = None
        got = 0
        if want:
            prows = rows[dpos[:want]]
            # Pinned first: spilling the CPU victims below must not evict (and overwrite) the
            # very disk blocks this chunk is about to read.
            want_dslots = d_s[dpos[:want]]
            on_disk = want_dslots >= 0
            s.disk_pin(want_dslots[on_disk])
            slots = s.cpu.reserve(prows)
            short = want - len(slots)
            if short:
                victims, spill = self._room.evict_cpu(short)
                if len(victims):
                    s.cpu.reassign(victims, prows[len(slots) : len(slots) + len(victims)])
                    slots = np.concatenate([slots, victims])
            got = len(slots)
            s.disk_unpin(want_dslots[got:][on_disk[got:]])
            if got:
                src[dpos[:got]] = slots
                d, r = on_disk[:got], ~on_disk[:got]
                if d.any():
                    promote = PromoteJob(prows[:got][d], want_dslots[:got][d], slots[d], dpos[:got][d])
                if r.any():
                    fetch = PromoteJob(prows[:got][r], EMPTY, slots[r], dpos[:got][r], REMOTE_TO_CPU)
        if got < len(dpos):  # the next hit has no CPU slot yet: this chunk ends before it
            end = int(dpos[got])
            s.cpu.unpin(src[end:][cpu_ready[end:cut]])
            src, stop = src[:end], "room"
        return LoadPlan(
            src,
            promote,
            spill,
            stop,
            pinned=src[cpu_ready[: len(src)]],
            exclusive=exclusive,
            fetch=fetch,
            remote_spill=self._room.take_remote_spill(),
        )

    def _prepare_cpu(self, keys: Sequence[bytes], exclusive: bool) -> LoadPlan:
        """prepare_load with no tier below the CPU: one native call finds and pins the READY run."""
        src, n, pending = self._s.cpu.plan_load(keys)
        run = len(src)
        stop = "" if run == len(keys) else ("in_flight" if run < n and pending else "miss")
        return LoadPlan(
            src,
            None,
            None,
            stop,
            pinned=src.copy(),
            exclusive=exclusive,
            remote_spill=self._room.take_remote_spill(),
        )

    def _prepare_staged(self, rows, cpu_s, cpu_ready, d_s, run: int, stop: str, max_promote: int) -> LoadPlan:
        """An exclusive load: every block of the chunk goes through a staging row.

        Disk and remote hits are read into staging rows; CPU hits are copied there
        (``restage``) and their CPU slots demoted at once. The CPU tier then gives up
        exactly the blocks moving up, before the engine saves what its GPU blocks held.
        """
        s = self._s
        take = min(run, s.staging.count - s.staging.in_use, max(1, max_promote))
        if take == 0:
            return LoadPlan(stop="room" if run else stop, exclusive=True)
        staged = s.staging.take(take)
        c = cpu_ready[:take]
        on_disk = (d_s[:take] >= 0) & ~c
        far = ~c & ~on_disk
        pos = np.arange(take, dtype=np.int64)
        cpu_src = cpu_s[:take][c]
        s.cpu.pin(cpu_src)  # until restaged
        s.disk_pin(d_s[:take][on_disk])
        promote = (
            PromoteJob(rows[:take][on_disk], d_s[:take][on_disk], staged[on_disk], pos[on_disk])
            if on_disk.any()
            else None
        )
        fetch = PromoteJob(rows[:take][far], EMPTY, staged[far], pos[far], REMOTE_TO_CPU) if far.any() else None
        return LoadPlan(
            staged,
            promote,
            None,
            "room" if take < run else stop,
            pinned=cpu_src,
            exclusive=True,
            fetch=fetch,
            staged=staged,
            restage=(cpu_src, staged[c]),
        )

    def hold_run(self, keys: Sequence[bytes]) -> RunHold:
        """Pin the CPU and disk blocks of the keys' leading run for an exclusive load.

        Its chunks go up one at a time, and the engine saves its own victims after the
        first: without the hold, that save could push out the blocks of the later chunks,
        which a flat cache would find (it looks a request up before it inserts anything).
        """
        s = self._s
        n = first_repeat(keys)
        if n == 0:
            return RunHold(EMPTY, EMPTY, EMPTY, EMPTY)
        rows = key_rows(keys[:n], s.key_bytes)
        cpu_s = s.cpu.find_ready(rows)
        d_s = s.disk.find_ready(rows) if s.disk is not None else np.full(n, -1, dtype=np.int64)
        d_s[cpu_s >= 0] = -1
        miss = (cpu_s < 0) & (d_s < 0)
        run = int(np.argmax(miss)) if miss.any() else n
        cpu_pos = np.flatnonzero(cpu_s[:run] >= 0)
        disk_pos = np.flatnonzero(d_s[:run] >= 0)
        hold = RunHold(cpu_pos, cpu_s[cpu_pos], disk_pos, d_s[disk_pos])
        s.cpu.pin(hold.cpu_slots)
        s.disk_pin(hold.disk_slots)
        return hold

    def release_hold(self, hold: RunHold, stop: int) -> None:
        """Unpin the held blocks of positions below ``stop`` (a chunk's own pins take over)."""
        s = self._s
        c = hold.cpu_pos < stop
        d = hold.disk_pos < stop
        s.cpu.unpin(hold.cpu_slots[c])
        s.disk_unpin(hold.disk_slots[d])
        hold.cpu_pos, hold.cpu_slots = hold.cpu_pos[~c], hold.cpu_slots[~c]
        hold.disk_pos, hold.disk_slots = hold.disk_pos[~d], hold.disk_slots[~d]

    def complete_restage(self, plan: LoadPlan) -> None:
        """The CPU hits are in their staging rows: their CPU copies become the first to go."""
        s = self._s
        src, _ = plan.restage
        s.cpu.unpin(plan.pinned)
        plan.pinned = EMPTY
        s.cpu.demote(src[::-1], loaded=True)
        plan.restage = None

    def _commit_promoted(self, plan: LoadPlan, job: PromoteJob, ok: np.ndarray) -> int:
        s = self._s
        if len(plan.staged):  # read into staging rows: nothing joins the CPU tier
            return len(plan) if ok.all() else int(job.positions[np.argmax(~ok)])
        good, bad = job.cpu_slots[ok], job.cpu_slots[~ok]
        s.cpu.commit(good)
        s.cpu.pin(good)
        plan.pinned = np.concatenate([plan.pinned, good])
        s.cpu.abort(bad)
        return len(plan) if ok.all() else int(job.positions[np.argmax(~ok)])

    def complete_promote(self, plan: LoadPlan, ok: np.ndarray, *, corrupt: bool = True) -> int:
        """Commit verified disk promotions; the run ends at the first one that failed. Returns its length.

        ``corrupt``: the failed blocks failed verification and are dropped from the disk tier;
        False when the whole read failed (an I/O fault), which says nothing about the data.
        """
        s = self._s
        job = plan.promote
        ok = np.asarray(ok, dtype=bool)
        s.disk.unpin(job.disk_slots)
        # The disk copy of a promoted block stays while it is clean and room is not short:
        # first to go when the disk needs room, touched again if the CPU evicts the block.
        s.disk.demote(job.disk_slots[ok], loaded=True)
        n = self._commit_promoted(plan, job, ok)
        if ok.all() or not corrupt:
            return n
        bad_disk = job.disk_slots[~ok]
        droppable = bad_disk[(s.disk.pins[bad_disk] == 0) & (s.disk.state[bad_disk] == READY)]
        if len(droppable):
            s.event("dropped", "disk", s.disk.keys.slot_keys[droppable])
            s.disk.drop(droppable)
            s.disk_invalidate.append(droppable)
        return n

    def complete_fetch(self, plan: LoadPlan, ok: np.ndarray) -> int:
        """Commit the remote blocks that arrived and verified; the run ends at the first one that did not."""
        return self._commit_promoted(plan, plan.fetch, np.asarray(ok, dtype=bool))

    def complete_load(self, plan: LoadPlan, loaded: int) -> None:
        """Release the plan's pins; the loaded run is touched last block first.

        An exclusive load (the engine keeps the blocks and stores them back when its
        own cache evicts them) demotes the CPU copies instead: first eviction
        candidates, dropped rather than spilled, made recent again by that store.
        """
        s = self._s
        s.cpu.unpin(plan.pinned)
        plan.pinned = EMPTY
        src = plan.cpu_slots[:loaded][::-1]
        if len(plan.staged):
            s.staging.give(plan.staged)
            plan.staged = EMPTY
            return  # its CPU hits were demoted when they were restaged
        if plan.exclusive:
            s.cpu.demote(src, loaded=True)
        else:
            s.cpu.touch(src)

    def abort_load(self, plan: LoadPlan) -> None:
        """Undo a plan whose promotions never ran (the dispatcher refused them before any read)."""
        s = self._s
        if plan.promote is not None:
            s.disk.unpin(plan.promote.disk_slots)
        if len(plan.staged):
            s.staging.give(plan.staged)
            plan.staged = EMPTY
        else:
            for job in (plan.promote, plan.fetch):
                if job is not None:
                    s.cpu.abort(job.cpu_slots)
        s.cpu.unpin(plan.pinned)
        plan.pinned = EMPTY
