"""TierManager: every tier's index, policy, pins and placement decisions, with no awaits.

The shape follows vLLM's kv_offload manager: ``lookup``; ``prepare_store`` ->
a plan of slots (plus the spill its evictions imply) -> ``complete_store(ok)``;
``prepare_load`` -> a plan (CPU hits pinned, disk hits to promote) ->
``loads.complete_promote`` -> ``complete_load``; ``room.complete_spill``; ``take_events``.
It never touches bytes and never awaits, so it is testable without an event
loop; transfer/ executes its plans (the plan and finish phases of a move are here).

Composed, not inherited: one TierState (state.py) that a store planner (storing.py), a load
planner (loading.py) and a room finder (spills.py) share; the runners call those parts directly
(``stores``, ``loads``, ``room``) but for the plan and finish doors a caller under the state lock
goes through (``prepare_store``, ``complete_store``, ``prepare_load``, ``complete_load``, ``touch``),
and this class looks up, announces, hints and demotes.

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

from collections.abc import Callable, Sequence

import numpy as np

from ..core import core
from .key_rows import key_rows
from .loading import LoadPlanner
from .plans import LoadPlan, LookupResult, SpillJob, StorePlan
from .sessions import Sessions
from .spills import RoomFinder
from .state import Staging, TierState
from .storing import StorePlanner
from .tier_index import EMPTY, TierIndex, join_hierarchy

EVENT_KINDS = ("stored", "evicted", "spilled", "dropped")


class TierManager:
    """Bookkeeping for the CPU tier, an optional disk tier and an optional remote tier.

    Its parts share one TierState (``state``): the store planner (``stores``: storing.py) plans,
    commits and touches stores, the load planner (``loads``: loading.py) plans and commits loads, the
    room finder (``room``: spills.py) evicts, spills and writes to the remote tier. The runners
    (transfer/runners/) call those parts directly, but for the five plan and finish doors below;
    this class builds them, looks up, announces, hints, demotes and hands out events. Calls come one at a time: from the loop thread, or from
    vLLM's scheduler thread holding the cache's state lock (state_lock.py). The remote tier has no
    slots here: ``attach_remote`` gives its residency filter (``known(rows) -> bool[n]``, all False
    while the tier is degraded).
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
        # CPU and disk are exclusive and run one policy (native/domain.hpp): a block's history
        # follows it down and up, the policy's victim leaves wherever it lives, and what spills is
        # the CPU block the policy ranks first among the CPU's.
        cpu, disk, domain = self.new_tiers(policy, cpu_slots, disk_slots, key_bytes)
        self._s = self.state_type(
            cpu,
            disk,
            domain,
            key_bytes,
            staging_slots=staging_slots,
            protect_share=protect_share,
            session_idle_s=session_idle_s,
            max_events=max_events,
            on_event=on_event,
        )
        self.room = RoomFinder(self._s)
        self.loads = LoadPlanner(self._s, self.room)
        self.stores = StorePlanner(self._s, self.room, write_through=write_through)

    # A differential test builds the same manager over reference tiers (tests/reference_core/twins.py).
    state_type = TierState

    @staticmethod
    def new_tiers(policy: str, cpu_slots: int, disk_slots: int | None, key_bytes: int) -> tuple:
        """(cpu, disk or None, the domain joining them or None)."""
        if disk_slots:
            return join_hierarchy(policy, cpu_slots, disk_slots, key_bytes)
        return TierIndex("cpu", cpu_slots, key_bytes, policy), None, None

    # -- what callers read ------------------------------------------------------------
    @property
    def state(self) -> TierState:
        """What the parts share (state.py): the runners ask it whether room may come free."""
        return self._s

    @property
    def key_bytes(self) -> int:
        return self._s.key_bytes

    @property
    def cpu(self) -> TierIndex:
        return self._s.cpu

    @property
    def disk(self) -> TierIndex | None:
        return self._s.disk

    @property
    def domain(self) -> object | None:
        return self._s.domain

    @property
    def sessions(self) -> Sessions:
        return self._s.sessions

    @property
    def staging(self) -> Staging | None:
        return self._s.staging

    @property
    def staging_in_use(self) -> int:
        s = self._s
        return s.staging.in_use if s.staging is not None else 0

    @property
    def announced(self) -> dict[bytes, int]:
        """Keys a store has announced but not yet placed (in flight for lookups), with their counts."""
        return self._s.announced

    @property
    def disk_writable(self) -> bool:
        return self._s.disk_writable

    @property
    def disk_invalidate(self) -> list[np.ndarray]:
        """Disk slots dropped for good that the disk store has yet to forget (``take_disk_invalidations``)."""
        return self._s.disk_invalidate

    # -- what the tiers below tell it -------------------------------------------------
    def attach_remote(self, known: Callable[[np.ndarray], np.ndarray], write: str) -> None:
        """A remote tier is up: ``known`` is its residency filter, ``write`` its write mode
        ("write_through" after each store, or "write_back" on eviction)."""
        s = self._s
        s.remote_known = known
        s.remote_write = write

    def restore_disk(self, keys: list[bytes], slots: list[int]) -> None:
        """The disk blocks an earlier run committed (the disk store recovered them), READY again."""
        if self._s.disk is not None:
            self._s.disk.restore(keys, slots)

    def stop_disk_writes(self) -> None:
        """The disk tier degraded: evicted blocks are dropped, never spilled, from now on."""
        self._s.disk_writable = False

    def take_disk_invalidations(self) -> np.ndarray | None:
        """The disk slots dropped for good since the last call (the disk store journals them), or None."""
        s = self._s
        if not s.disk_invalidate:
            return None
        slots = np.concatenate(s.disk_invalidate)
        s.disk_invalidate.clear()
        return slots

    # -- lookup -----------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest leading run of keys READY or in flight over CPU and disk; no I/O."""
        s = self._s
        n = len(keys)
        if n == 0:
            return LookupResult()
        if s.fused and not s.announced and s.remote_known is None:  # the common case: one native call
            run, n_cpu, n_disk = core.leading_run(s.cpu, s.disk, keys)
            return LookupResult(run, n_cpu, n_disk, run - n_cpu - n_disk, 0)
        rows = key_rows(keys, s.key_bytes)
        _, cpu_ready, _, disk_ready, pending = s.locate(rows)
        if cpu_ready.all():
            return LookupResult(n, n, 0, 0)
        hit = cpu_ready | disk_ready | pending
        s.mark_announced(keys, hit, pending)
        remote = np.zeros(n, dtype=bool)
        if s.remote_known is not None:
            far = np.flatnonzero(~hit)
            remote[far] = s.remote_hits(rows[far])
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
        s = self._s
        if not len(keys):
            return []
        rows = key_rows(keys, s.key_bytes)
        at = s.locate(rows)
        where = np.full(len(keys), "", dtype=object)
        where[at.cpu_ready] = "cpu"
        where[at.disk_ready] = "disk"
        local = (at.cpu >= 0) | (at.disk >= 0)  # READY, or in flight: lookup counts those as pending
        if s.remote_known is not None:
            s.mark_announced(keys, local, np.zeros(len(keys), dtype=bool))  # in flight for lookup too
            far = np.flatnonzero(~local)
            where[far[s.remote_hits(rows[far])]] = "remote"
        return where.tolist()

    # -- the plan and finish doors a caller under the state lock goes through ------------
    # Kept on the manager (the rest of the parts' methods are called on the parts): the step protocol's
    # lock check (tests/vllm/test_step_loop_calls.py) watches these names on the manager.
    def prepare_store(
        self, keys: Sequence[bytes], gpu_ids: np.ndarray, prefix: Sequence[bytes] = ()
    ) -> StorePlan:
        """Reserve CPU slots for the keys not yet resident; evictions become a spill job or drops."""
        return self.stores.prepare(keys, gpu_ids, prefix)

    def complete_store(self, plan: StorePlan, ok: bool) -> SpillJob | None:
        """Commit (or abort) the plan's slots; returns a write-through spill job when one is due."""
        return self.stores.complete(plan, ok)

    def touch(self, keys: Sequence[bytes], skip: np.ndarray = EMPTY, *, held: bool = False) -> None:
        """Mark resident keys as used, last first, so a prefix's head is the most recent (see StorePlanner.touch)."""
        self.stores.touch(keys, skip, held=held)

    def prepare_load(self, keys: Sequence[bytes], max_promote: int, *, exclusive: bool = False) -> LoadPlan:
        """Pin the leading run's CPU hits; reserve CPU slots for up to ``max_promote`` disk or remote hits."""
        return self.loads.prepare(keys, max_promote, exclusive=exclusive)

    def complete_load(self, plan: LoadPlan, loaded: int) -> None:
        self.loads.complete_load(plan, loaded)

    # -- announced stores ------------------------------------------------------------
    def announce(self, keys: Sequence[bytes]) -> None:
        """A store of these keys will be placed soon: until then lookups count them in flight."""
        s = self._s
        for key in keys:
            s.announced[key] = s.announced.get(key, 0) + 1

    def withdraw(self, keys: Sequence[bytes]) -> None:
        s = self._s
        for key in keys:
            left = s.announced.get(key, 0) - 1
            if left > 0:
                s.announced[key] = left
            else:
                s.announced.pop(key, None)

    # -- session hints ---------------------------------------------------------------
    def hint(self, session, keys: Sequence[bytes], protect: bool = False) -> None:
        """``keys`` are the live session's current chain; ``protect``: a follow-up is expected."""
        s = self._s
        rows = key_rows(keys, s.key_bytes).copy() if len(keys) else np.zeros((0, s.key_bytes), np.uint8)
        s.sessions.register(session, rows, protect)  # protected blocks outrank the rest (ranking.py)

    def release(self, session) -> list[bytes]:
        """The session ended: its chain's unshared blocks become first eviction candidates everywhere.

        Returns those keys (chain order) so the engine can do the same in its own cache.
        """
        s = self._s
        rows = s.sessions.release(session)
        if not len(rows):
            return []
        self._demote_rows(rows[::-1])  # the chain's tail goes first
        return [bytes(r) for r in rows]

    def demote(self, keys: Sequence[bytes]) -> int:
        """Put the READY blocks of ``keys`` at the cold end of every tier that holds them: the first to go
        when a tier needs room, dropped, never spilled (a touch takes them out again). Keys not held, or
        only in flight, are left alone. Returns the blocks demoted (a key in two tiers counts twice)."""
        return self._demote_rows(key_rows(keys, self._s.key_bytes)) if len(keys) else 0

    def _demote_rows(self, rows: np.ndarray) -> int:
        n = 0
        for tier in (self._s.cpu, self._s.disk):
            if tier is not None:
                slots = tier.find_ready(rows)
                slots = slots[slots >= 0]
                slots = slots[np.sort(np.unique(slots, return_index=True)[1])]  # a repeated key once, in order
                tier.demote(slots)
                n += len(slots)
        return n

    # -- events ----------------------------------------------------------------------
    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        """(kind, tier, keys) since the last call, oldest first; kinds: stored, evicted, spilled, dropped."""
        return self._s.take_events()

    def check_invariants(self) -> None:
        s = self._s
        s.cpu.check_invariants()
        if s.disk is not None:
            s.disk.check_invariants()
