"""The manager's spills: room in the CPU tier (what moves down, what leaves), disk room, remote writes.

A mixin of TierManager (manager.py), which owns the tiers, sessions and events these read. With a disk
tier, one native call (``Tier.make_room``) applies the hierarchy's one policy; protected sessions' blocks
are held while it picks (ranking.py).
"""

from __future__ import annotations

import numpy as np

from .plans import SpillJob, StorePlan
from .ranking import merge_victims, ranked
from .tier_index import EMPTY, READY


class Spills:
    """CPU evictions and their spill jobs, disk reservations, remote write-back / write-through jobs."""

    def _evict_cpu(self, n: int, for_protected: bool = True) -> tuple[np.ndarray, SpillJob | None]:
        """Up to ``n`` CPU victims, sorted (the new keys get runs of consecutive slots), and their spill.
        ``for_protected`` False: the room is for blocks of no protected session (ranking.py)."""
        if self.domain is not None:
            return self._make_room(n, for_protected)
        cpu = self.cpu
        parts = ranked(self.sessions, (cpu,), n, lambda k, out: (cpu.evict(min(k, cpu.evictable - out)), cpu.evicted_cold),
                       for_protected)  # fmt: skip
        victims, n_cold = merge_victims([p[0] for p in parts], [p[1] for p in parts])
        if not len(victims):
            return victims, None
        if self.remote_write == "write_back":
            rows = self.cpu.keys.slot_keys[victims[n_cold:]]
            fresh = ~self.remote_hits(rows)
            if fresh.any():
                self._remote_spill = SpillJob(rows[fresh], victims[n_cold:][fresh], EMPTY, reuse=True)
        spill = self._spill_or_drop(victims, n_cold)
        return np.sort(victims), spill

    def _make_room(self, n: int, for_protected: bool) -> tuple[np.ndarray, SpillJob | None]:
        """``_evict_cpu`` under the hierarchy's policy: one native call picks the CPU slots (cold ones,
        blocks that leave, blocks that move down keeping their rank) and reserves the disk slots
        (a second one when protected blocks had to be held back first: ranking.py)."""
        parts = ranked(self.sessions, (self.cpu, self.disk), n, lambda k, out: self.cpu.make_room(min(k, self.cpu.evictable - out), self.disk_writable),
                       for_protected)  # fmt: skip
        victims, n_cold = merge_victims([p[0] for p in parts], [p[1] for p in parts])
        spill_cpu, spill_disk, dropped = (np.concatenate([p[i] for p in parts]) for i in (3, 4, 6))
        gone = np.concatenate([p[5] for p in parts])
        if not len(victims):
            return victims, None
        if self.remote_write == "write_back":
            rows = self.cpu.keys.slot_keys[victims[n_cold:]]
            fresh = ~self.remote_hits(rows)
            if fresh.any():
                self._remote_spill = SpillJob(rows[fresh], victims[n_cold:][fresh], EMPTY, reuse=True)
        self._event("evicted", "disk", gone)
        self._event("evicted", "cpu", self.cpu.keys.slot_keys[dropped])
        spill = SpillJob(self.cpu.keys.slot_keys[spill_cpu], spill_cpu, spill_disk, reuse=True) if len(spill_cpu) else None
        return np.sort(victims), spill

    def take_remote_spill(self) -> SpillJob | None:
        """The write-back job to the remote tier that the last plan's evictions made (once)."""
        job, self._remote_spill = self._remote_spill, None
        return job

    def remote_write_job(self, plan: StorePlan) -> SpillJob | None:
        """Write-through to the remote tier: the plan's new blocks Redis is not known to hold (pinned)."""
        if self.remote_write != "write_through" or not len(plan.cpu_slots):
            return None
        slots = plan.cpu_slots[self.cpu.state[plan.cpu_slots] == READY]
        rows = self.cpu.keys.slot_keys[slots]
        fresh = ~self.remote_hits(rows)
        if not fresh.any():
            return None
        self.cpu.pin(slots[fresh])  # servable meanwhile, and not evicted while it is read
        return SpillJob(rows[fresh], slots[fresh], EMPTY, reuse=False)

    def complete_remote_write(self, job: SpillJob) -> None:
        """A write to the remote tier ended (the residency knows what landed); release its pins."""
        if not job.reuse:
            self.cpu.unpin(job.cpu_slots)

    def _spill_or_drop(self, victims: np.ndarray, n_cold: int) -> SpillJob | None:
        """CPU victims (the first ``n_cold`` from the cold list) -> a spill job for the dirty ones.

        Cold victims are dropped: a faster tier holds them, or their session ended.
        Clean victims (already on disk) are dropped too, and their disk copy becomes
        the disk's most recent: CPU and disk together act as one exclusive LRU.
        """
        rows = self.cpu.keys.slot_keys[victims]
        if self.disk is None or not self.disk_writable:
            self._event("evicted", "cpu", rows)
            return None
        if n_cold:
            self._event("evicted", "cpu", rows[:n_cold])
            rows, victims = rows[n_cold:], victims[n_cold:]
        d_s = self.disk.keys.find(rows)
        dirty = d_s < 0
        if not dirty.all():
            self._event("evicted", "cpu", rows[~dirty])
            clean = d_s[~dirty]
            self.disk.touch(clean[self.disk.state[clean] == READY])  # oldest first, as evicted
        rows, cpu_slots = rows[dirty], victims[dirty]
        disk_slots = self._reserve_disk(rows)
        if len(disk_slots) < len(rows):
            self._event("dropped", "cpu", rows[len(disk_slots) :])
        if not len(disk_slots):
            return None
        return SpillJob(rows[: len(disk_slots)], cpu_slots[: len(disk_slots)], disk_slots, reuse=True)

    def _reserve_disk(self, rows: np.ndarray) -> np.ndarray:
        disk = self.disk
        slots = disk.reserve(rows)
        short = len(rows) - len(slots)
        if short:
            parts = ranked(self.sessions, (disk,), short, lambda k, out: (disk.evict(min(k, disk.evictable - out)),),
                           self.sessions.any_protected(rows[len(slots) :]))  # fmt: skip
            victims = np.sort(np.concatenate([p[0] for p in parts]))
            if len(victims):
                self._event("evicted", "disk", disk.keys.slot_keys[victims])
                disk.reassign(victims, rows[len(slots) : len(slots) + len(victims)])
                slots = np.concatenate([slots, victims])
        return slots

    def complete_spill(self, job: SpillJob, ok: np.ndarray) -> None:
        """Commit the disk slots that were written; a failed block is lost (counted by the caller)."""
        ok = np.asarray(ok, dtype=bool)
        self.disk.commit(job.disk_slots[ok])
        self.disk.abort(job.disk_slots[~ok])
        if ok.any():
            self._event("spilled", "disk", job.keys[ok])
        if not ok.all():
            self._event("dropped", "disk", job.keys[~ok])
        if not job.reuse:
            self.cpu.unpin(job.cpu_slots)
