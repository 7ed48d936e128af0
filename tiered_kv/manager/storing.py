"""The manager's store planner: reserve CPU slots for a store's new keys (evicting through the room
finder when the free ones run out), commit or abort them, and touch what is already resident.

One object the manager holds (manager.py), over the tiers of its TierState.
prepare -> complete(ok) -> the write-through spill job, if one is due.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .key_rows import key_rows, repeats
from .plans import SpillJob, StorePlan
from .spills import RoomFinder
from .state import TierState
from .tier_index import EMPTY


class StorePlanner:
    """Store plans over the manager's tiers; ``write_through``: every stored block is spilled to disk too."""

    def __init__(self, state: TierState, room: RoomFinder, *, write_through: bool) -> None:
        self._s = state
        self._room = room
        self._write_through = write_through

    def prepare(self, keys: Sequence[bytes], gpu_ids: np.ndarray, prefix: Sequence[bytes] = ()) -> StorePlan:
        """Reserve CPU slots for the keys not yet resident; evictions become a spill job or drops.

        ``prefix``: the chain's keys before ``keys[0]`` (a continuation, e.g. the next chunk
        of a chunked prefill). The chain's resident blocks are held while this call evicts,
        so a continuation never evicts its own head (which would orphan everything after it).
        """
        s = self._s
        if s.fused and s.disk is None and s.remote_write is None and not s.sessions.n_protected:
            return self._prepare_cpu(keys, gpu_ids, prefix)
        n = len(keys)
        rows = key_rows(keys, s.key_bytes)
        cpu_s, cpu_ready, d_s, disk_ready, in_flight = s.locate(rows)
        resident = cpu_ready | disk_ready
        repeated = repeats(keys)
        if repeated is None:
            repeated = np.zeros(n, dtype=bool)
        new_idx = np.flatnonzero(~(resident | in_flight | repeated))
        slots = s.cpu.reserve(rows[new_idx])
        spill = None
        short = len(new_idx) - len(slots)
        if short:
            held_cpu, held_disk = self._hold_chain(cpu_s, d_s, resident, prefix)
            try:
                # Sorted, so the new keys get runs of consecutive slots (one copy per run).
                wanted = rows[new_idx[len(slots) :]]
                victims, spill = self._room.evict_cpu(short, s.sessions.any_protected(wanted))
                if len(victims):
                    s.cpu.reassign(victims, rows[new_idx[len(slots) : len(slots) + len(victims)]])
                    slots = np.concatenate([slots, victims])
            finally:
                s.cpu.unpin(held_cpu)
                if s.disk is not None:
                    s.disk.unpin(held_disk)
        placed = new_idx[: len(slots)]
        return StorePlan(
            keys=list(keys),
            gpu_ids=np.asarray(gpu_ids, dtype=np.int64)[placed],
            cpu_slots=slots,
            spill=spill,
            deduped=int(np.count_nonzero(resident | repeated)),
            in_flight=int(np.count_nonzero(in_flight & ~repeated)),
            unplaced_idx=new_idx[len(slots) :],
            prefix=list(prefix),
            remote_spill=self._room.take_remote_spill(),
        )

    def _prepare_cpu(self, keys: Sequence[bytes], gpu_ids: np.ndarray, prefix: Sequence[bytes]) -> StorePlan:
        """prepare_store with no tier below the CPU (so no spill) and no second chances: one native
        call finds the new keys, reserves their slots and evicts for the rest (core.Tier.plan_store)."""
        s = self._s
        new_idx, slots, evicted, deduped, in_flight = s.cpu.plan_store(keys, prefix)
        if len(evicted):
            s.event("evicted", "cpu", evicted)
        placed, unplaced = (
            (new_idx, EMPTY) if len(slots) == len(new_idx) else (new_idx[: len(slots)], new_idx[len(slots) :])
        )
        ids = (
            gpu_ids
            if type(gpu_ids) is np.ndarray and gpu_ids.dtype == np.int64
            else np.asarray(gpu_ids, dtype=np.int64)
        )
        return StorePlan(
            keys if type(keys) is list else list(keys),
            ids[placed],
            slots,
            None,
            deduped,
            in_flight,
            unplaced,
            prefix if type(prefix) is list else list(prefix),
            self._room.take_remote_spill(),
        )

    def _hold_chain(self, cpu_s, d_s, resident, prefix) -> tuple[np.ndarray, np.ndarray]:
        """Pin the resident blocks of the call's chain (prefix + its own resident keys) for one eviction."""
        s = self._s
        cpu_held = cpu_s[resident & (cpu_s >= 0)]
        disk_held = d_s[resident & (d_s >= 0)]  # all -1 without a disk tier
        if len(prefix):
            prows = key_rows(prefix, s.key_bytes)
            cpu_held = np.concatenate([cpu_held, s.cpu.find_ready(prows)])
            if s.disk is not None:
                disk_held = np.concatenate([disk_held, s.disk.find_ready(prows)])
        cpu_held = np.unique(cpu_held[cpu_held >= 0])
        disk_held = np.unique(disk_held[disk_held >= 0])
        s.cpu.pin(cpu_held)
        if s.disk is not None:
            s.disk.pin(disk_held)
        return cpu_held, disk_held

    def complete(self, plan: StorePlan, ok: bool) -> SpillJob | None:
        """Commit (or abort) the plan's slots; returns a write-through spill job when one is due."""
        s = self._s
        if not ok:
            s.cpu.abort(plan.cpu_slots)
            return None
        s.cpu.commit(plan.cpu_slots[::-1])
        if len(plan.cpu_slots):
            s.event("stored", "cpu", s.cpu.keys.slot_keys[plan.cpu_slots])
        if plan.prefix or len(plan.cpu_slots) != len(plan.keys):  # else the commit set the chain's order
            # Only the blocks that were already resident are re-referenced (a policy with a
            # window must see a new block once); the chain's head ends most recent.
            self.touch(plan.prefix + plan.keys, skip=plan.cpu_slots)
        if not (self._write_through and s.disk_writable and len(plan.cpu_slots)):
            return None
        return self._room.write_through_job(plan.cpu_slots)

    def touch(self, keys: Sequence[bytes], skip: np.ndarray = EMPTY, *, held: bool = False) -> None:
        """Mark resident keys as used, last first, so a prefix's head is the most recent.

        ``skip``: CPU slots just inserted by the caller, not touched again. ``held``: the engine
        holds these blocks (its own cache hit them): only the keys' history records the reference
        (the hierarchy's policy), copies here stay where they are. Otherwise keys no tier holds
        leave their history too.
        """
        s = self._s
        if not len(keys):
            return
        rows = key_rows(keys, s.key_bytes)[::-1]
        if held:
            if s.domain is not None:
                s.cpu.note(rows)  # only the keys neither tier holds
            return
        cpu_s = s.cpu.find_ready(rows)
        hit = cpu_s >= 0
        if len(skip):
            hit &= ~np.isin(cpu_s, skip)
        s.cpu.touch(cpu_s[hit])
        if s.disk is not None:
            # A block in the CPU tier leaves its disk copy where it is (a clean duplicate is
            # touched when the CPU evicts the block): the two tiers act as one exclusive LRU.
            rest = np.flatnonzero(cpu_s < 0)
            d_s = s.disk.find_ready(rows[rest])
            s.disk.touch(d_s[d_s >= 0])
            if s.domain is not None and (d_s < 0).any():
                s.cpu.note(rows[rest[d_s < 0]])  # held by no tier here (the engine's GPU): its history
