"""TierManager: every tier's index, policy, pins and placement decisions, with no awaits.

The shape follows vLLM's kv_offload manager: ``lookup``; ``prepare_store`` ->
a plan of slots (plus the spill its evictions imply) -> ``complete_store(ok)``;
``prepare_load`` -> a plan (CPU hits pinned, disk hits to promote) ->
``complete_promote`` -> ``complete_load``; ``complete_spill``; ``take_events``.
It never touches bytes and never awaits, so it is testable without an event
loop; the async mover executes its plans.

Placement: CPU and disk are exclusive and run one eviction policy (native/domain.hpp):
a key's recency, frequency and ghosts follow its block down and up. When the CPU needs
room, the block the policy ranks first among the CPU's moves down keeping its rank
(written back: a dirty one is written to disk before its slot's new owner is copied in,
a clean one takes its disk copy's place); when the disk is full too, the policy's victim
over both tiers leaves, wherever it lives. A promoted block's disk copy stays only as the
disk's first eviction candidate (see tier_index.py, the cold list).
Requests' keys are inserted and touched last block first, so a prefix's head is
always the most recent and its tail is evicted first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..core import core
from .loading import LoadPlanning, Staging, key_rows, repeats
from .plans import LookupResult, SpillJob, StorePlan
from .sessions import Sessions
from .spills import Spills
from .tier_index import EMPTY, TierIndex, join_hierarchy

EVENT_KINDS = ("stored", "evicted", "spilled", "dropped")


class TierManager(LoadPlanning, Spills):
    """Bookkeeping for the CPU tier, an optional disk tier and an optional remote tier (loop thread only).

    The remote tier has no slots here: ``remote_known(rows) -> bool[n]`` (set by the facade,
    all False while the tier is degraded) says which keys it believes Redis holds.
    """

    def __init__(
        self,
        cpu_slots: int,
        disk_slots: int | None,
        key_bytes: int,
        policy: str = "lru",
        *,
        write_through: bool = False,
        max_events: int = 1 << 16,
        staging_slots: int = 0,
        protect_share: float = 0.0,
        session_idle_s: float = 600.0,
        on_event: Callable[[str, str, int], None] | None = None,
    ) -> None:
        self.key_bytes = key_bytes
        # CPU and disk are exclusive and run one policy (native/domain.hpp): a block's history
        # follows it down and up, the policy's victim leaves wherever it lives, and what spills is
        # the CPU block the policy ranks first among the CPU's.
        self.domain = None
        if disk_slots:
            self.cpu, self.disk, self.domain = join_hierarchy(policy, cpu_slots, disk_slots, key_bytes)
        else:
            self.cpu, self.disk = TierIndex("cpu", cpu_slots, key_bytes, policy), None
        self.disk_writable = self.disk is not None  # the facade clears it when the disk tier degrades
        self.write_through = write_through
        self._events: deque[tuple[str, str, np.ndarray]] = deque(maxlen=max_events)
        self.disk_invalidate: list[np.ndarray] = []  # disk slots dropped for good: the store forgets them
        self._on_event = on_event  # (kind, tier, count): the facade's metrics
        self.sessions = Sessions(key_bytes, max_protected=int(protect_share * (cpu_slots + (disk_slots or 0))),
                                 idle_s=session_idle_s)  # fmt: skip
        # Slab rows cpu_slots .. cpu_slots + staging_slots - 1: exclusive loads stage through them.
        self.staging = Staging(cpu_slots, staging_slots) if staging_slots > 0 else None
        self.remote_known: Callable[[np.ndarray], np.ndarray] | None = None  # set by the facade
        self.remote_write: str | None = None  # "write_through" | "write_back" when a remote tier is up
        self._remote_spill: SpillJob | None = None  # write-back job of the last CPU eviction, for its plan
        self.announced: dict[bytes, int] = {}  # keys a store has announced but not yet placed: in flight
        # The core's fused entry points for the common cases (a lookup, a store into a CPU tier with
        # nothing below it): one native call each. The general paths below give the same answers.
        self.fused = True

    # -- lookup -----------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest leading run of keys READY or in flight over CPU and disk; no I/O."""
        n = len(keys)
        if n == 0:
            return LookupResult()
        if self.fused and not self.announced and self.remote_known is None:  # the common case: one native call
            run, n_cpu, n_disk = core.leading_run(self.cpu, self.disk, keys)
            return LookupResult(run, n_cpu, n_disk, run - n_cpu - n_disk, 0)
        rows = key_rows(keys, self.key_bytes)
        _, cpu_ready, _, disk_ready, pending = self.locate(rows)
        if cpu_ready.all():
            return LookupResult(n, n, 0, 0)
        hit = cpu_ready | disk_ready | pending
        self.mark_announced(keys, hit, pending)
        remote = np.zeros(n, dtype=bool)
        if self.remote_known is not None:
            far = np.flatnonzero(~hit)
            remote[far] = self.remote_hits(rows[far])
            hit |= remote
        run = int(np.argmin(hit)) if not hit.all() else n
        n_cpu = int(np.count_nonzero(cpu_ready[:run]))
        n_disk = int(np.count_nonzero(disk_ready[:run]))
        n_remote = int(np.count_nonzero(remote[:run]))
        return LookupResult(run, n_cpu, n_disk, run - n_cpu - n_disk - n_remote, n_remote)

    def tiers_of(self, keys: Sequence[bytes]) -> list[str]:
        """The tier each key is READY in ("cpu", then "disk"), "remote" for a key held in neither
        (nor in flight there) that the remote residency filter knows, else "" (for reports; vectorized).

        "remote" follows ``lookup``: only keys with no CPU or disk entry in any state are asked about."""
        if not len(keys):
            return []
        rows = key_rows(keys, self.key_bytes)
        at = self.locate(rows)
        where = np.full(len(keys), "", dtype=object)
        where[at.cpu_ready] = "cpu"
        where[at.disk_ready] = "disk"
        local = (at.cpu >= 0) | (at.disk >= 0)  # READY, or in flight: lookup counts those as pending
        if self.remote_known is not None:
            self.mark_announced(keys, local, np.zeros(len(keys), dtype=bool))  # in flight for lookup too
            far = np.flatnonzero(~local)
            where[far[self.remote_hits(rows[far])]] = "remote"
        return where.tolist()

    # -- store -----------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes], gpu_ids: np.ndarray, prefix: Sequence[bytes] = ()) -> StorePlan:
        """Reserve CPU slots for the keys not yet resident; evictions become a spill job or drops.

        ``prefix``: the chain's keys before ``keys[0]`` (a continuation, e.g. the next chunk
        of a chunked prefill). The chain's resident blocks are held while this call evicts,
        so a continuation never evicts its own head (which would orphan everything after it).
        """
        if self.fused and self.disk is None and self.remote_write is None and not self.sessions.n_protected:
            return self._prepare_store_cpu(keys, gpu_ids, prefix)
        n = len(keys)
        rows = key_rows(keys, self.key_bytes)
        cpu_s, cpu_ready, d_s, disk_ready, in_flight = self.locate(rows)
        resident = cpu_ready | disk_ready
        repeated = repeats(keys)
        if repeated is None:
            repeated = np.zeros(n, dtype=bool)
        new_idx = np.flatnonzero(~(resident | in_flight | repeated))
        slots = self.cpu.reserve(rows[new_idx])
        spill = None
        short = len(new_idx) - len(slots)
        if short:
            held_cpu, held_disk = self._hold_chain(cpu_s, d_s, resident, prefix)
            try:
                # Sorted, so the new keys get runs of consecutive slots (one copy per run).
                wanted = rows[new_idx[len(slots) :]]
                victims, spill = self._evict_cpu(short, self.sessions.any_protected(wanted))
                if len(victims):
                    self.cpu.reassign(victims, rows[new_idx[len(slots) : len(slots) + len(victims)]])
                    slots = np.concatenate([slots, victims])
            finally:
                self.cpu.unpin(held_cpu)
                if self.disk is not None:
                    self.disk.unpin(held_disk)
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
            remote_spill=self.take_remote_spill(),
        )

    def _prepare_store_cpu(self, keys: Sequence[bytes], gpu_ids: np.ndarray, prefix: Sequence[bytes]) -> StorePlan:
        """prepare_store with no tier below the CPU (so no spill) and no second chances: one native
        call finds the new keys, reserves their slots and evicts for the rest (core.Tier.plan_store)."""
        new_idx, slots, evicted, deduped, in_flight = self.cpu.plan_store(keys, prefix)
        if len(evicted):
            self._event("evicted", "cpu", evicted)
        placed, unplaced = (new_idx, EMPTY) if len(slots) == len(new_idx) else (new_idx[: len(slots)], new_idx[len(slots) :])
        ids = gpu_ids if type(gpu_ids) is np.ndarray and gpu_ids.dtype == np.int64 else np.asarray(gpu_ids, dtype=np.int64)
        return StorePlan(
            keys if type(keys) is list else list(keys), ids[placed], slots, None, deduped, in_flight, unplaced,
            prefix if type(prefix) is list else list(prefix), self.take_remote_spill(),
        )  # fmt: skip

    def _hold_chain(self, cpu_s, d_s, resident, prefix) -> tuple[np.ndarray, np.ndarray]:
        """Pin the resident blocks of the call's chain (prefix + its own resident keys) for one eviction."""
        cpu_held = cpu_s[resident & (cpu_s >= 0)]
        disk_held = d_s[resident & (d_s >= 0)]  # all -1 without a disk tier
        if len(prefix):
            prows = key_rows(prefix, self.key_bytes)
            cpu_held = np.concatenate([cpu_held, self.cpu.find_ready(prows)])
            if self.disk is not None:
                disk_held = np.concatenate([disk_held, self.disk.find_ready(prows)])
        cpu_held = np.unique(cpu_held[cpu_held >= 0])
        disk_held = np.unique(disk_held[disk_held >= 0])
        self.cpu.pin(cpu_held)
        if self.disk is not None:
            self.disk.pin(disk_held)
        return cpu_held, disk_held

    def complete_store(self, plan: StorePlan, ok: bool) -> SpillJob | None:
        """Commit (or abort) the plan's slots; returns a write-through spill job when one is due."""
        if not ok:
            self.cpu.abort(plan.cpu_slots)
            return None
        self.cpu.commit(plan.cpu_slots[::-1])
        if len(plan.cpu_slots):
            self._event("stored", "cpu", self.cpu.keys.slot_keys[plan.cpu_slots])
        if plan.prefix or len(plan.cpu_slots) != len(plan.keys):  # else the commit set the chain's order
            # Only the blocks that were already resident are re-referenced (a policy with a
            # window must see a new block once); the chain's head ends most recent.
            self.touch(plan.prefix + plan.keys, skip=plan.cpu_slots)
        if not (self.write_through and self.disk_writable and len(plan.cpu_slots)):
            return None
        return self._write_through_job(plan.cpu_slots)

    def _write_through_job(self, cpu_slots: np.ndarray) -> SpillJob | None:
        rows = self.cpu.keys.slot_keys[cpu_slots]
        absent = self.disk.keys.find(rows) < 0
        cpu_slots, rows = cpu_slots[absent], rows[absent]
        disk_slots = self._reserve_disk(rows)
        if not len(disk_slots):
            return None
        cpu_slots = cpu_slots[: len(disk_slots)]
        self.cpu.pin(cpu_slots)  # the copy stays servable, and is not evicted while it is read
        return SpillJob(rows[: len(disk_slots)], cpu_slots, disk_slots, reuse=False)

    def touch(self, keys: Sequence[bytes], skip: np.ndarray = EMPTY, *, held: bool = False) -> None:
        """Mark resident keys as used, last first, so a prefix's head is the most recent.

        ``skip``: CPU slots just inserted by the caller, not touched again. ``held``: the engine
        holds these blocks (its own cache hit them): only the keys' history records the reference
        (the hierarchy's policy), copies here stay where they are. Otherwise keys no tier holds
        leave their history too.
        """
        if not len(keys):
            return
        rows = key_rows(keys, self.key_bytes)[::-1]
        if held:
            if self.domain is not None:
                self.cpu.note(rows)  # only the keys neither tier holds
            return
        cpu_s = self.cpu.find_ready(rows)
        hit = cpu_s >= 0
        if len(skip):
            hit &= ~np.isin(cpu_s, skip)
        self.cpu.touch(cpu_s[hit])
        if self.disk is not None:
            # A block in the CPU tier leaves its disk copy where it is (a clean duplicate is
            # touched when the CPU evicts the block): the two tiers act as one exclusive LRU.
            rest = np.flatnonzero(cpu_s < 0)
            d_s = self.disk.find_ready(rows[rest])
            self.disk.touch(d_s[d_s >= 0])
            if self.domain is not None and (d_s < 0).any():
                self.cpu.note(rows[rest[d_s < 0]])  # held by no tier here (the engine's GPU): its history

    # -- announced stores ------------------------------------------------------------
    def announce(self, keys: Sequence[bytes]) -> None:
        """A store of these keys will be placed soon: until then lookups count them in flight."""
        for key in keys:
            self.announced[key] = self.announced.get(key, 0) + 1

    def withdraw(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            left = self.announced.get(key, 0) - 1
            if left > 0:
                self.announced[key] = left
            else:
                self.announced.pop(key, None)

    def mark_announced(self, keys: Sequence[bytes], hit: np.ndarray, pending: np.ndarray) -> None:
        """Set ``pending`` (and ``hit``) for announced keys among the misses (a Python step per miss,
        only while some store is announced: the announcements are few, the misses short)."""
        if self.announced:
            ann = self.announced
            for i in np.flatnonzero(~hit).tolist():
                if keys[i] in ann:
                    pending[i] = hit[i] = True

    # -- session hints ---------------------------------------------------------------
    def hint(self, session, keys: Sequence[bytes], protect: bool = False) -> None:
        """``keys`` are the live session's current chain; ``protect``: a follow-up is expected."""
        rows = key_rows(keys, self.key_bytes).copy() if len(keys) else np.zeros((0, self.key_bytes), np.uint8)
        self.sessions.register(session, rows, protect)  # protected blocks outrank the rest (ranking.py)

    def release(self, session) -> list[bytes]:
        """The session ended: its chain's unshared blocks become first eviction candidates everywhere.

        Returns those keys (chain order) so the engine can do the same in its own cache.
        """
        rows = self.sessions.release(session)
        if not len(rows):
            return []
        tail_first = rows[::-1]
        for tier in (self.cpu, self.disk):
            if tier is not None:
                slots = tier.find_ready(tail_first)
                slots = slots[slots >= 0]
                tier.demote(slots[np.sort(np.unique(slots, return_index=True)[1])])  # a repeated key once
        return [bytes(r) for r in rows]

    # -- events ----------------------------------------------------------------------
    def _event(self, kind: str, tier: str, rows: np.ndarray) -> None:
        if len(rows):
            # Every caller passes a fancy-indexed copy (or a view of one) that nothing mutates later.
            self._events.append((kind, tier, rows))
            if self._on_event is not None:
                self._on_event(kind, tier, len(rows))

    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        """(kind, tier, keys) since the last call, oldest first; kinds: stored, evicted, spilled, dropped."""
        out = [(kind, tier, [bytes(r) for r in rows]) for kind, tier, rows in self._events]
        self._events.clear()
        return out

    def check_invariants(self) -> None:
        self.cpu.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()
