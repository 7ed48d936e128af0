"""The manager's room finder: room in the CPU tier (what moves down, what leaves), disk room, remote writes.

One object the manager holds (manager.py), over the tiers, sessions and events of its TierState. With a
disk tier, one native call (``Tier.make_room``) applies the hierarchy's one policy; protected sessions'
blocks are held while it picks (ranking.py). It plans spill jobs and commits them when they end; the
write-back job to the remote tier that an eviction makes waits here until the plan that caused it
takes it (``take_remote_spill``).
"""

from __future__ import annotations

import numpy as np

from ..media import CPU_TO_REMOTE
from .plans import SpillJob, StorePlan
from .ranking import merge_victims, ranked
from .state import TierState
from .tier_index import EMPTY, READY


class RoomFinder:
    """CPU evictions and their spill jobs, disk reservations, remote write-back / write-through jobs."""

    def __init__(self, state: TierState) -> None:
        self._s = state
        self._remote_spill: SpillJob | None = None  # write-back job of the last CPU eviction, for its plan

    def evict_cpu(self, n: int, for_protected: bool = True) -> tuple[np.ndarray, SpillJob | None]:
        """Up to ``n`` CPU victims, sorted (the new keys get runs of consecutive slots), and their spill.
        ``for_protected`` False: the room is for blocks of no protected session (ranking.py)."""
        s = self._s
        if s.domain is not None:
            return self._make_room(n, for_protected)
        cpu = s.cpu

        def take(k: int, out: int) -> tuple[np.ndarray, int]:
            return cpu.evict(min(k, cpu.evictable - out)), cpu.evicted_cold

        parts = ranked(s.sessions, (cpu,), n, take, for_protected)
        victims, n_cold = merge_victims([p[0] for p in parts], [p[1] for p in parts])
        if not len(victims):
            return victims, None
        self._write_back(victims[n_cold:])
        spill = self._spill_or_drop(victims, n_cold)
        return np.sort(victims), spill

    def _make_room(self, n: int, for_protected: bool) -> tuple[np.ndarray, SpillJob | None]:
        """``evict_cpu`` under the hierarchy's policy: one native call picks the CPU slots (cold ones,
        blocks that leave, blocks that move down keeping their rank) and reserves the disk slots
        (a second one when protected blocks had to be held back first: ranking.py)."""
        s = self._s
        cpu = s.cpu

        def take(k: int, out: int) -> tuple:
            return cpu.make_room(min(k, cpu.evictable - out), s.disk_writable)

        parts = ranked(s.sessions, (cpu, s.disk), n, take, for_protected)
        victims, n_cold = merge_victims([p[0] for p in parts], [p[1] for p in parts])
        spill_cpu, spill_disk, dropped = (np.concatenate([p[i] for p in parts]) for i in (3, 4, 6))
        gone = np.concatenate([p[5] for p in parts])
        if not len(victims):
            return victims, None
        self._write_back(victims[n_cold:])
        s.event("evicted", "disk", gone)
        s.event("evicted", "cpu", cpu.keys.slot_keys[dropped])
        spill = None
        if len(spill_cpu):
            spill = SpillJob(cpu.keys.slot_keys[spill_cpu], spill_cpu, spill_disk, reuse=True)
        return np.sort(victims), spill

    def _write_back(self, victims: np.ndarray) -> None:
        """With a write-back remote tier, the victims Redis is not known to hold go there first."""
        s = self._s
        if s.remote_write != "write_back":
            return
        rows = s.cpu.keys.slot_keys[victims]
        fresh = ~s.remote_hits(rows)
        if fresh.any():
            self._remote_spill = SpillJob(rows[fresh], victims[fresh], EMPTY, reuse=True, media=CPU_TO_REMOTE)

    def take_remote_spill(self) -> SpillJob | None:
        """The write-back job to the remote tier that the last plan's evictions made (once)."""
        job, self._remote_spill = self._remote_spill, None
        return job

    def remote_write_job(self, plan: StorePlan) -> SpillJob | None:
        """Write-through to the remote tier: the plan's new blocks Redis is not known to hold (pinned)."""
        s = self._s
        if s.remote_write != "write_through" or not len(plan.cpu_slots):
            return None
        slots = plan.cpu_slots[s.cpu.state[plan.cpu_slots] == READY]
        rows = s.cpu.keys.slot_keys[slots]
        fresh = ~s.remote_hits(rows)
        if not fresh.any():
            return None
        s.cpu.pin(slots[fresh])  # servable meanwhile, and not evicted while it is read
        return SpillJob(rows[fresh], slots[fresh], EMPTY, reuse=False, media=CPU_TO_REMOTE)

    def complete_remote_write(self, job: SpillJob) -> None:
        """A write to the remote tier ended (the residency knows what landed); release its pins."""
        if not job.reuse:
            self._s.cpu.unpin(job.cpu_slots)

    def _spill_or_drop(self, victims: np.ndarray, n_cold: int) -> SpillJob | None:
        """CPU victims (the first ``n_cold`` from the cold list) -> a spill job for the dirty ones.

        Cold victims are dropped: a faster tier holds them, or their session ended.
        Clean victims (already on disk) are dropped too, and their disk copy becomes
        the disk's most recent: CPU and disk together act as one exclusive LRU.
        """
        s = self._s
        rows = s.cpu.keys.slot_keys[victims]
        if s.disk is None or not s.disk_writable:
            s.event("evicted", "cpu", rows)
            return None
        if n_cold:
            s.event("evicted", "cpu", rows[:n_cold])
            rows, victims = rows[n_cold:], victims[n_cold:]
        d_s = s.disk.keys.find(rows)
        dirty = d_s < 0
        if not dirty.all():
            s.event("evicted", "cpu", rows[~dirty])
            clean = d_s[~dirty]
            s.disk.touch(clean[s.disk.state[clean] == READY])  # oldest first, as evicted
        rows, cpu_slots = rows[dirty], victims[dirty]
        disk_slots = self.reserve_disk(rows)
        if len(disk_slots) < len(rows):
            s.event("dropped", "cpu", rows[len(disk_slots) :])
        if not len(disk_slots):
            return None
        return SpillJob(rows[: len(disk_slots)], cpu_slots[: len(disk_slots)], disk_slots, reuse=True)

    def reserve_disk(self, rows: np.ndarray) -> np.ndarray:
        """Disk slots for ``rows`` (RESERVED), evicting disk blocks when the free ones run out."""
        s = self._s
        disk = s.disk
        slots = disk.reserve(rows)
        short = len(rows) - len(slots)
        if short:

            def take(k: int, out: int) -> tuple[np.ndarray]:
                return (disk.evict(min(k, disk.evictable - out)),)

            parts = ranked(s.sessions, (disk,), short, take, s.sessions.any_protected(rows[len(slots) :]))
            victims = np.sort(np.concatenate([p[0] for p in parts]))
            if len(victims):
                s.event("evicted", "disk", disk.keys.slot_keys[victims])
                disk.reassign(victims, rows[len(slots) : len(slots) + len(victims)])
                slots = np.concatenate([slots, victims])
        return slots

    def write_through_job(self, cpu_slots: np.ndarray) -> SpillJob | None:
        """The just-stored blocks the disk does not hold yet, as a spill that keeps them in the CPU tier."""
        s = self._s
        rows = s.cpu.keys.slot_keys[cpu_slots]
        absent = s.disk.keys.find(rows) < 0
        cpu_slots, rows = cpu_slots[absent], rows[absent]
        disk_slots = self.reserve_disk(rows)
        if not len(disk_slots):
            return None
        cpu_slots = cpu_slots[: len(disk_slots)]
        s.cpu.pin(cpu_slots)  # the copy stays servable, and is not evicted while it is read
        return SpillJob(rows[: len(disk_slots)], cpu_slots, disk_slots, reuse=False)

    def complete_spill(self, job: SpillJob, ok: np.ndarray) -> None:
        """Commit the disk slots that were written; a failed block is lost (counted by the caller)."""
        s = self._s
        ok = np.asarray(ok, dtype=bool)
        s.disk.commit(job.disk_slots[ok])
        s.disk.abort(job.disk_slots[~ok])
        if ok.any():
            s.event("spilled", "disk", job.keys[ok])
        if not ok.all():
            s.event("dropped", "disk", job.keys[~ok])
        if not job.reuse:
            s.cpu.unpin(job.cpu_slots)
