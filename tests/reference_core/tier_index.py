"""Reference model of one tier's bookkeeping (tiered_kv/manager/tier_index.py says what it does), in numpy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tiered_kv.errors import TieredKVError

from .free_runs import FreeRuns
from .inputs import check_distinct_slots
from .keytable import KeyTable
from .policy import EvictionPolicy, LRUPolicy, make_policy

FREE, RESERVED, READY = 0, 1, 2
_MAX_PINS = np.iinfo(np.uint16).max
EMPTY = np.empty(0, dtype=np.int64)


class TierIndex:
    """Slots of one tier; the eviction policy orders its READY, unpinned slots."""

    def __init__(self, name: str, num_slots: int, key_bytes: int, policy: str | EvictionPolicy = "lru") -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise TieredKVError(f"tier {name!r} needs at least one slot, got {num_slots!r}")
        self.name = name
        self.num_slots = num_slots
        self.keys = KeyTable(num_slots, key_bytes)
        self.state = np.zeros(num_slots, dtype=np.uint8)
        self.pins = np.zeros(num_slots, dtype=np.uint16)
        # The free slots as runs (free_runs.py): a reservation takes the longest runs first, so it
        # forms as few runs of consecutive slots (one copy each) as the free slots allow.
        self._runs = FreeRuns(num_slots)
        self.n_reserved = 0
        self.n_ready = 0
        self.n_ready_pinned = 0  # READY slots with pins > 0 (not evictable)
        self.policy = make_policy(policy, num_slots, key_tag=self.keys.key_tags) if isinstance(policy, str) else policy
        self.cold = LRUPolicy(num_slots)
        self.evicted_cold = 0  # how many of the last evict()'s victims (the leading ones) came from the cold list

    # -- queries ----------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        return self._runs.count

    @property
    def used(self) -> int:
        return self.num_slots - self._runs.count

    def free_runs(self) -> np.ndarray:
        """The free slots' maximal runs as (start, length) rows, ascending."""
        return np.array(self._runs.runs(), dtype=np.int64).reshape(-1, 2)

    @property
    def evictable(self) -> int:
        return self.n_ready - self.n_ready_pinned

    def find(self, keys: Sequence[bytes]) -> np.ndarray:
        """Slot of each key (READY or RESERVED), -1 if absent."""
        return self.keys.find(keys)

    def find_ready(self, keys: Sequence[bytes]) -> np.ndarray:
        """Slot of each READY key, -1 otherwise."""
        slots = self.keys.find(keys)
        hit = slots >= 0
        slots[hit & (self.state[np.where(hit, slots, 0)] != READY)] = -1
        return slots

    def resident(self) -> dict[bytes, int]:
        """READY key -> slot, as a dict (O(n) Python objects: for tests and debugging only)."""
        slots = np.flatnonzero(self.state == READY)
        return dict(zip(self.keys.keys_of(slots), slots.tolist(), strict=True))

    def nbytes(self) -> int:
        parts = (self.keys, self.state, self.pins, self._runs, self.policy, self.cold)
        return sum(part.nbytes for part in parts)

    # -- reserve -> commit | abort -----------------------------------------------------
    def reserve(self, keys: Sequence[bytes] | np.ndarray) -> np.ndarray:
        """Reserve free slots for the leading keys that fit (keys must be absent); ascending slots."""
        n = min(len(keys), self._runs.count)
        if n == 0:
            return EMPTY
        slots = self._runs.take(n)
        try:
            self.keys.insert(keys[:n], slots)  # raises before anything else changes if a key is present
        except TieredKVError:
            self._runs.give(slots)
            raise
        self.state[slots] = RESERVED
        self.n_reserved += n
        return slots

    def reassign(self, slots: np.ndarray, keys: Sequence[bytes] | np.ndarray) -> None:
        """Hand evicted slots (READY, out of the policy, unpinned) to new keys, RESERVED."""
        self._expect(slots, READY)
        if np.any(self.pins[slots]):
            raise TieredKVError(f"{self.name}: cannot reassign pinned slots")
        old = self.keys.slot_keys[slots].copy()
        self.keys.remove(slots)
        try:
            self.keys.insert(keys, slots)
        except TieredKVError:  # the old keys go back: a refused reassign changes nothing (as native)
            self.keys.insert(old, slots)
            raise
        self.state[slots] = RESERVED
        self.n_ready -= len(slots)
        self.n_reserved += len(slots)

    def commit(self, slots: np.ndarray) -> None:
        """The slots' bytes have landed: READY and tracked; the LAST slot ends most recent."""
        if not len(slots):
            return
        self._expect(slots, RESERVED)
        self.state[slots] = READY
        self.n_reserved -= len(slots)
        self.n_ready += len(slots)
        self.n_ready_pinned += int(np.count_nonzero(self.pins[slots]))
        self.policy.insert(slots)

    def abort(self, slots: np.ndarray) -> None:
        """Give back RESERVED slots whose copy failed, was cancelled, or never started."""
        if not len(slots):
            return
        self._expect(slots, RESERVED)
        if np.any(self.pins[slots]):
            raise TieredKVError(f"{self.name}: cannot abort pinned slots")
        self.keys.remove(slots)
        self.state[slots] = FREE
        self.n_reserved -= len(slots)
        self._push_free(slots)

    def drop(self, slots: np.ndarray) -> None:
        """Forget READY, unpinned blocks (evicted, corrupt, or replaced); their slots become free."""
        if not len(slots):
            return
        self._expect(slots, READY)
        if np.any(self.pins[slots]):
            raise TieredKVError(f"{self.name}: cannot drop pinned slots")
        self.policy.remove(slots)  # a no-op for victims evict() already took out
        self.cold.remove(slots)
        self.keys.remove(slots)
        self.state[slots] = FREE
        self.n_ready -= len(slots)
        self._push_free(slots)

    def evict(self, n: int) -> np.ndarray:
        """Exactly n unpinned READY victims, out of the policy but still READY; or none.

        The caller drops or reassigns every victim before it returns to the loop
        (they still count as READY and evictable until then).
        """
        self.evicted_cold = 0
        if n <= 0 or n > self.evictable:
            return EMPTY
        return self._evict_cold_then(n, lambda k: self.policy.evict(k, self.pins))

    def _evict_cold_then(self, n: int, rest) -> np.ndarray:
        """Cold candidates first, then ``rest(k)`` for the others; the cold ones leave their list only
        once the rest is found, so a refused evict (earlier victims still outstanding) changes nothing."""
        cand = self.cold._log.candidates(n, self.pins) if len(self.cold) else None
        k = cand.slots.size if cand is not None else 0
        victims = rest(n - k) if k < n else EMPTY
        if len(victims) != n - k:  # the counts disagree with the lists (outstanding victims): refused
            raise TieredKVError(f"{self.name}: evict({n}): {self.evictable} evictable slots counted but only {k} "
                                f"cold and fewer than {n - k} in the policy found")  # fmt: skip
        cold = cand.slots.copy() if k else EMPTY
        if k:
            self.cold._log.commit(k, cand)
        self.evicted_cold = k
        return np.concatenate([cold, victims]) if k else victims

    def demote(self, slots: np.ndarray, *, loaded: bool = False) -> None:
        """Make READY slots the first eviction candidates (oldest first in array order).

        ``loaded``: the blocks were hits that moved up to a faster tier; a policy with
        a ``demote`` hook (the window's) remembers them as re-referenced.
        """
        slots = slots[self.state[slots] == READY] if len(slots) else slots
        if not len(slots):
            return
        slots = slots[self.cold.stamp_of(slots) < 0]
        check_distinct_slots(slots, "demote")  # before anything changes, as the native core
        (self.policy.demote if loaded else self.policy.remove)(slots)
        self.cold.insert(slots)

    def plan_store(self, keys: list[bytes], prefix: list[bytes]) -> tuple:
        """native Tier::plan_store (plan_store.py)."""
        from .plan_store import plan_store

        return plan_store(self, list(keys), list(prefix))

    # -- pins --------------------------------------------------------------------------
    def pin(self, slots: np.ndarray) -> None:
        """Protect slots from eviction while they are read; a batch holds distinct slots."""
        if not len(slots):
            return
        check_distinct_slots(slots, "pin")  # a repeat would step past _MAX_PINS unchecked
        if np.any(self.state[slots] == FREE):
            bad = int(slots[np.argmax(self.state[slots] == FREE)])
            raise TieredKVError(f"{self.name}: pin of slot {bad}, which is FREE (holds no block)")
        pins = self.pins[slots]
        if np.any(pins == _MAX_PINS):
            raise TieredKVError(f"{self.name}: more than {_MAX_PINS} concurrent pins on one slot")
        self.n_ready_pinned += int(np.count_nonzero((pins == 0) & (self.state[slots] == READY)))
        self.pins[slots] = pins + 1

    def unpin(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        check_distinct_slots(slots, "unpin")
        pins = self.pins[slots]
        if np.any(pins == 0):
            raise TieredKVError(f"{self.name}: unpin of a slot that is not pinned")
        self.pins[slots] = pins - 1
        self.n_ready_pinned -= int(np.count_nonzero((pins == 1) & (self.state[slots] == READY)))

    def touch(self, slots: np.ndarray) -> None:
        """Record hits; the LAST slot ends most recent. A cold slot goes back to the policy."""
        if not len(slots):
            return
        if len(self.cold):
            cold = slots[self.cold.stamp_of(slots) >= 0]
            if len(cold):
                cold = np.unique(cold)
                self.cold.remove(cold)
                self.policy.insert(cold)
        self.policy.touch(slots)

    # -- restore after restart ---------------------------------------------------------
    def restore(self, keys: Sequence[bytes], slots: np.ndarray) -> None:
        """Re-insert blocks recovered from persistent storage, oldest first, into an empty index."""
        if self.n_ready or self.n_reserved:
            raise TieredKVError(f"{self.name}: restore needs an empty index")
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots or len(np.unique(slots)) != len(slots)):
            raise TieredKVError(f"{self.name}: recovered slots are out of range or used twice")
        self.keys.insert(keys, slots)
        self.state[slots] = READY
        self.n_ready = len(slots)
        self.policy.insert(slots)
        used = np.zeros(self.num_slots, dtype=bool)
        used[slots] = True
        self._runs.reset(used)

    # -- internals ---------------------------------------------------------------------
    def _expect(self, slots: np.ndarray, expected: int) -> None:
        check_distinct_slots(slots, "batch")  # before anything changes, as the native core
        states = self.state[slots]
        if np.any(states != expected):
            bad = int(slots[np.argmax(states != expected)])
            raise TieredKVError(
                f"{self.name}: slot {bad} is in state {int(self.state[bad])}, expected {expected}"
            )

    def _push_free(self, slots: np.ndarray) -> None:
        if self._runs.count + len(slots) > self.num_slots:
            raise TieredKVError(f"{self.name}: more slots freed than exist")
        self._runs.give(slots)

    def check_invariants(self) -> None:
        """Every slot accounted for exactly once (tests call this after stress)."""
        is_free = self._runs.free
        st = self.state
        if np.any(is_free != (st == FREE)):
            raise TieredKVError(f"{self.name}: free list and FREE states disagree")
        if np.any(self.pins[st == FREE]):
            raise TieredKVError(f"{self.name}: a FREE slot is pinned")
        holds = self.keys.has_key(np.arange(self.num_slots, dtype=np.int64))
        if np.any(holds != (st != FREE)):
            raise TieredKVError(f"{self.name}: a slot's key and its state disagree")
        if int(np.count_nonzero(st == READY)) != self.n_ready or int(np.count_nonzero(st == RESERVED)) != self.n_reserved:
            raise TieredKVError(f"{self.name}: state counts drifted")
        pinned_ready = int(np.count_nonzero((st == READY) & (self.pins > 0)))
        if pinned_ready != self.n_ready_pinned:
            raise TieredKVError(f"{self.name}: pinned READY count drifted ({self.n_ready_pinned} vs {pinned_ready})")
        tracked = np.zeros(self.num_slots, dtype=np.int64)
        for order in (self.policy.order(), self.cold.order()):
            tracked[np.asarray(order, dtype=np.int64)] += 1
        if np.any(tracked != (st == READY)):
            raise TieredKVError(f"{self.name}: READY slots and the policy + cold lists disagree")
        self.keys.check_invariants()
