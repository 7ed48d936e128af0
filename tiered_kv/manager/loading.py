"""The load half of the TierManager: plan a load (CPU hits pinned, disk and remote hits
promoted into reserved CPU slots), commit the promotions, release the plan.

A mixin, so the manager's state (``cpu``, ``disk``, ``remote_known``, the spill logic)
is shared with the store half in manager.py without passing it around.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..core import core
from .plans import LoadPlan, Located, PromoteJob
from .tier_index import EMPTY, READY


def key_rows(keys: Sequence[bytes], key_bytes: int) -> np.ndarray:
    """The keys as one ``uint8[n, key_bytes]`` array (keys are validated by the caller)."""
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), key_bytes)


def repeats(keys: Sequence[bytes]) -> np.ndarray | None:
    """True for each key that repeats an earlier one; None when none does (the common case, checked at C speed)."""
    if len(set(keys)) == len(keys):
        return None
    seen: set[bytes] = set()
    mask = np.zeros(len(keys), dtype=bool)
    for i, key in enumerate(keys):
        mask[i] = key in seen
        seen.add(key)
    return mask


def first_repeat(keys: Sequence[bytes]) -> int:
    """Index of the first key that repeats an earlier one, or len(keys)."""
    mask = repeats(keys)
    return len(keys) if mask is None else int(np.argmax(mask))


@dataclass
class RunHold:
    """Pins an exclusive load holds on its run's blocks (positions in its keys), released chunk by chunk."""

    cpu_pos: np.ndarray
    cpu_slots: np.ndarray
    disk_pos: np.ndarray
    disk_slots: np.ndarray


class Staging:
    """Slab rows past the CPU tier's slots, for exclusive loads.

    An exclusive load reads its disk and remote hits into these rows and copies them on to
    the engine, which keeps the blocks: the load then displaces no CPU block (and so
    pushes nothing out of the disk), as moving a block up one exclusive hierarchy should.
    """

    def __init__(self, first: int, count: int) -> None:
        self.count = count
        self._free = np.arange(first + count - 1, first - 1, -1, dtype=np.int64)  # popped ascending
        self._n = count

    @property
    def in_use(self) -> int:
        return self.count - self._n

    def take(self, n: int) -> np.ndarray:
        k = min(n, self._n)
        out = np.sort(self._free[self._n - k : self._n])
        self._n -= k
        return out

    def give(self, slots: np.ndarray) -> None:
        k = len(slots)
        self._free[self._n : self._n + k] = np.sort(slots)[::-1]
        self._n += k


class LoadPlanning:
    """prepare_load -> (complete_promote, complete_fetch) -> complete_load | abort_load."""

    @property
    def staging_in_use(self) -> int:
        return self.staging.in_use if self.staging is not None else 0

    def remote_hits(self, rows: np.ndarray) -> np.ndarray:
        """Which rows the remote tier is believed to hold (all False without one, or degraded)."""
        known = self.remote_known
        return known(rows) if known is not None and len(rows) else np.zeros(len(rows), dtype=bool)

    def locate(self, rows: np.ndarray) -> Located:
        """Each key's CPU slot and state; for a key with no CPU entry (in any state: one in flight
        into the CPU tier is waited for, even if it is elsewhere too), its disk slot and state.
        One native call over both tiers."""
        return Located(*core.locate(self.cpu, self.disk, rows))

    def prepare_load(self, keys: Sequence[bytes], max_promote: int, *, exclusive: bool = False) -> LoadPlan:
        """Pin the leading run's CPU hits; reserve CPU slots for up to ``max_promote`` disk or remote hits."""
        if (self.fused and self.disk is None and self.remote_known is None and not self.announced and len(keys)
                and not (exclusive and self.staging is not None)):  # fmt: skip
            return self._prepare_load_cpu(keys, exclusive)
        n = first_repeat(keys)
        if n == 0:
            return LoadPlan(stop="miss" if len(keys) else "")
        rows = key_rows(keys[:n], self.key_bytes)
        cpu_s, cpu_ready, d_s, disk_ready, pending = self.locate(rows)
        d_s = np.where(disk_ready, d_s, -1)
        hit = cpu_ready | disk_ready
        self.mark_announced(keys, hit, pending)
        hit &= ~pending  # announced keys are not loadable yet: the run stops there, in flight
        remote = np.zeros(n, dtype=bool)
        far = np.flatnonzero((cpu_s < 0) & ~hit & ~pending)
        if len(far):
            remote[far] = self.remote_hits(rows[far])
            hit |= remote
        run = int(np.argmin(hit)) if not hit.all() else n
        stop = "" if run == len(keys) else ("in_flight" if run < n and pending[run] else "miss")
        if exclusive and self.staging is not None:
            return self._prepare_staged(rows, cpu_s, cpu_ready, d_s, run, stop, max_promote)
        dpos = np.flatnonzero(~cpu_ready[:run])  # disk and remote hits: each needs a CPU slot
        want = min(len(dpos), max(0, max_promote))
        # This chunk ends before the first hit it cannot promote; only its own CPU hits are
        # pinned (before any eviction below), so hits further on never crowd out its promotions.
        cut = int(dpos[want]) if want < len(dpos) else run
        src = cpu_s[:cut].copy()
        self.cpu.pin(src[cpu_ready[:cut]])
        promote = fetch = spill = None
        got = 0
        if want:
            prows = rows[dpos[:want]]
            # Pinned first: spilling the CPU victims below must not evict (and overwrite) the
            # very disk blocks this chunk is about to read.
            want_dslots = d_s[dpos[:want]]
            on_disk = want_dslots >= 0
            self.disk_pin(want_dslots[on_disk])
            slots = self.cpu.reserve(prows)
            short = want - len(slots)
            if short:
                victims, spill = self._evict_cpu(short)
                if len(victims):
                    self.cpu.reassign(victims, prows[len(slots) : len(slots) + len(victims)])
                    slots = np.concatenate([slots, victims])
            got = len(slots)
            self.disk_unpin(want_dslots[got:][on_disk[got:]])
            if got:
                src[dpos[:got]] = slots
                d, r = on_disk[:got], ~on_disk[:got]
                if d.any():
                    promote = PromoteJob(prows[:got][d], want_dslots[:got][d], slots[d], dpos[:got][d])
                if r.any():
                    fetch = PromoteJob(prows[:got][r], EMPTY, slots[r], dpos[:got][r])
        if got < len(dpos):  # the next hit has no CPU slot yet: this chunk ends before it
            end = int(dpos[got])
            self.cpu.unpin(src[end:][cpu_ready[end:cut]])
            src, stop = src[:end], "room"
        return LoadPlan(src, promote, spill, stop, pinned=src[cpu_ready[: len(src)]], exclusive=exclusive,
                        fetch=fetch, remote_spill=self.take_remote_spill())  # fmt: skip

    def _prepare_load_cpu(self, keys: Sequence[bytes], exclusive: bool) -> LoadPlan:
        """prepare_load with no tier below the CPU: one native call finds and pins the READY run."""
        src, n, pending = self.cpu.plan_load(keys)
        run = len(src)
        stop = "" if run == len(keys) else ("in_flight" if run < n and pending else "miss")
        return LoadPlan(src, None, None, stop, pinned=src.copy(), exclusive=exclusive,
                        remote_spill=self.take_remote_spill())  # fmt: skip

    def _prepare_staged(self, rows, cpu_s, cpu_ready, d_s, run: int, stop: str, max_promote: int) -> LoadPlan:
        """An exclusive load: every block of the chunk goes through a staging row.

        Disk and remote hits are read into staging rows; CPU hits are copied there
        (``restage``) and their CPU slots demoted at once. The CPU tier then gives up
        exactly the blocks moving up, before the engine saves what its GPU blocks held.
        """
        take = min(run, self.staging.count - self.staging.in_use, max(1, max_promote))
        if take == 0:
            return LoadPlan(stop="room" if run else stop, exclusive=True)
        staged = self.staging.take(take)
        c = cpu_ready[:take]
        on_disk = (d_s[:take] >= 0) & ~c
        far = ~c & ~on_disk
        pos = np.arange(take, dtype=np.int64)
        cpu_src = cpu_s[:take][c]
        self.cpu.pin(cpu_src)  # until restaged
        self.disk_pin(d_s[:take][on_disk])
        promote = PromoteJob(rows[:take][on_disk], d_s[:take][on_disk], staged[on_disk], pos[on_disk]) \
            if on_disk.any() else None  # fmt: skip
        fetch = PromoteJob(rows[:take][far], EMPTY, staged[far], pos[far]) if far.any() else None
        return LoadPlan(staged, promote, None, "room" if take < run else stop, pinned=cpu_src, exclusive=True,
                        fetch=fetch, staged=staged, restage=(cpu_src, staged[c]))  # fmt: skip

    def hold_run(self, keys: Sequence[bytes]) -> RunHold:
        """Pin the CPU and disk blocks of the keys' leading run for an exclusive load.

        Its chunks go up one at a time, and the engine saves its own victims after the
        first: without the hold, that save could push out the blocks of the later chunks,
        which a flat cache would find (it looks a request up before it inserts anything).
        """
        n = first_repeat(keys)
        if n == 0:
            return RunHold(EMPTY, EMPTY, EMPTY, EMPTY)
        rows = key_rows(keys[:n], self.key_bytes)
        cpu_s = self.cpu.find_ready(rows)
        d_s = self.disk.find_ready(rows) if self.disk is not None else np.full(n, -1, dtype=np.int64)
        d_s[cpu_s >= 0] = -1
        miss = (cpu_s < 0) & (d_s < 0)
        run = int(np.argmax(miss)) if miss.any() else n
        cpu_pos = np.flatnonzero(cpu_s[:run] >= 0)
        disk_pos = np.flatnonzero(d_s[:run] >= 0)
        hold = RunHold(cpu_pos, cpu_s[cpu_pos], disk_pos, d_s[disk_pos])
        self.cpu.pin(hold.cpu_slots)
        self.disk_pin(hold.disk_slots)
        return hold

    def release_hold(self, hold: RunHold, stop: int) -> None:
        """Unpin the held blocks of positions below ``stop`` (a chunk's own pins take over)."""
        c = hold.cpu_pos < stop
        d = hold.disk_pos < stop
        self.cpu.unpin(hold.cpu_slots[c])
        self.disk_unpin(hold.disk_slots[d])
        hold.cpu_pos, hold.cpu_slots = hold.cpu_pos[~c], hold.cpu_slots[~c]
        hold.disk_pos, hold.disk_slots = hold.disk_pos[~d], hold.disk_slots[~d]

    def complete_restage(self, plan: LoadPlan) -> None:
        """The CPU hits are in their staging rows: their CPU copies become the first to go."""
        src, _ = plan.restage
        self.cpu.unpin(plan.pinned)
        plan.pinned = EMPTY
        self.cpu.demote(src[::-1], loaded=True)
        plan.restage = None

    def disk_pin(self, slots: np.ndarray) -> None:
        if self.disk is not None:
            self.disk.pin(slots)

    def disk_unpin(self, slots: np.ndarray) -> None:
        if self.disk is not None:
            self.disk.unpin(slots)

    def _commit_promoted(self, plan: LoadPlan, job: PromoteJob, ok: np.ndarray) -> int:
        if len(plan.staged):  # read into staging rows: nothing joins the CPU tier
            return len(plan) if ok.all() else int(job.positions[np.argmax(~ok)])
        good, bad = job.cpu_slots[ok], job.cpu_slots[~ok]
        self.cpu.commit(good)
        self.cpu.pin(good)
        plan.pinned = np.concatenate([plan.pinned, good])
        self.cpu.abort(bad)
        return len(plan) if ok.all() else int(job.positions[np.argmax(~ok)])

    def complete_promote(self, plan: LoadPlan, ok: np.ndarray, *, corrupt: bool = True) -> int:
        """Commit verified disk promotions; the run ends at the first one that failed. Returns its length.

        ``corrupt``: the failed blocks failed verification and are dropped from the disk tier;
        False when the whole read failed (an I/O fault), which says nothing about the data.
        """
        job = plan.promote
        ok = np.asarray(ok, dtype=bool)
        self.disk.unpin(job.disk_slots)
        # The disk copy of a promoted block stays while it is clean and room is not short:
        # first to go when the disk needs room, touched again if the CPU evicts the block.
        self.disk.demote(job.disk_slots[ok], loaded=True)
        n = self._commit_promoted(plan, job, ok)
        if ok.all() or not corrupt:
            return n
        bad_disk = job.disk_slots[~ok]
        droppable = bad_disk[(self.disk.pins[bad_disk] == 0) & (self.disk.state[bad_disk] == READY)]
        if len(droppable):
            self._event("dropped", "disk", self.disk.keys.slot_keys[droppable])
            self.disk.drop(droppable)
            self.disk_invalidate.append(droppable)
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
        self.cpu.unpin(plan.pinned)
        plan.pinned = EMPTY
        src = plan.cpu_slots[:loaded][::-1]
        if len(plan.staged):
            self.staging.give(plan.staged)
            plan.staged = EMPTY
            return  # its CPU hits were demoted when they were restaged
        if plan.exclusive:
            self.cpu.demote(src, loaded=True)
        else:
            self.cpu.touch(src)

    def abort_load(self, plan: LoadPlan) -> None:
        """Undo a plan whose promotions never ran (the mover refused them before any read)."""
        if plan.promote is not None:
            self.disk.unpin(plan.promote.disk_slots)
        if len(plan.staged):
            self.staging.give(plan.staged)
            plan.staged = EMPTY
        else:
            for job in (plan.promote, plan.fetch):
                if job is not None:
                    self.cpu.abort(job.cpu_slots)
        self.cpu.unpin(plan.pinned)
        plan.pinned = EMPTY
