"""Per-tier bookkeeping: key -> slot, slot states, pin counts, free slots.

Synchronous and loop-thread only, so it needs no locks: callers never await
between a check and the mutation that depends on it.

Memory: a 1 TB tier of 16 KiB blocks holds 64M blocks, so nothing here is a
Python object per slot except the key itself and its dict entry. READY and
in-flight (RESERVED) keys live in two dicts so that ``lookup`` is one dict
membership test per key.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from .errors import TieredKVError
from .policy import EvictionPolicy, make_policy

FREE, RESERVED, READY = 0, 1, 2


@dataclass(frozen=True)
class LookupResult:
    """Leading run of resident keys, split by tier.

    ``in_flight`` is True when the run stopped at a key whose store or spill
    is still in flight: not a hit yet, but not worth recomputing either.
    """

    total: int = 0
    cpu: int = 0
    disk: int = 0
    in_flight: bool = False


class TierIndex:
    """Slots of one tier; the eviction policy orders its READY slots."""

    def __init__(self, name: str, num_slots: int, policy: str | EvictionPolicy = "lru") -> None:
        if num_slots <= 0:
            raise TieredKVError(f"tier {name!r} needs at least one slot, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self.ready: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        self.slot_key: list[bytes | None] = [None] * num_slots
        self.state = bytearray(num_slots)
        self.pins = array("I", bytes(4 * num_slots))
        self.pinned_ready = 0  # READY slots in the policy with pins > 0: not evictable
        self.detached: set[int] = set()  # evicted but still READY (e.g. being spilled): out of the policy
        # Popping from the end hands out ascending slots first, so fresh
        # reservations form contiguous runs that copy in one call.
        self._free = array("i", range(num_slots - 1, -1, -1))
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy

    # -- queries --------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def evictable(self) -> int:
        return len(self.policy) - self.pinned_ready

    def _protected(self, slot: int) -> bool:
        return self.pins[slot] > 0

    # -- reserve -> commit | abort ----------------------------------------------------
    def reserve_many(self, keys: list[bytes]) -> list[int]:
        """Reserve slots for the leading ``keys`` that fit (absent keys only), ascending slot order.

        Ascending slots make contiguous runs, which copy in one call.
        """
        n = min(len(keys), len(self._free))
        if n == 0:
            return []
        free = self._free
        slots = sorted(free[-n:])
        del free[-n:]
        state, slot_key, pending = self.state, self.slot_key, self.pending
        for key, slot in zip(keys, slots, strict=False):
            if key in self.ready or key in pending:
                raise TieredKVError(f"{self.name}: key {key.hex()[:16]} is already present")
            state[slot] = RESERVED
            slot_key[slot] = key
            pending[key] = slot
        return slots

    def reserve(self, key: bytes) -> int | None:
        """Take a free slot for ``key`` (state RESERVED); None when none is free."""
        if key in self.ready or key in self.pending:
            raise TieredKVError(f"{self.name}: key {key.hex()[:16]} is already present")
        if not self._free:
            return None
        slot = self._free.pop()
        self.state[slot] = RESERVED
        self.slot_key[slot] = key
        self.pending[key] = slot
        return slot

    def commit(self, slot: int) -> None:
        """The slot's bytes have landed: make it READY and evictable."""
        key = self._key_in_state(slot, RESERVED)
        del self.pending[key]
        self.ready[key] = slot
        self.state[slot] = READY
        self.policy.insert(slot, key)
        if self.pins[slot]:
            self.pinned_ready += 1

    def abort(self, slot: int) -> None:
        """Give back a RESERVED slot whose copy failed, was cancelled, or never started."""
        key = self._key_in_state(slot, RESERVED)
        del self.pending[key]
        self._release(slot)

    def drop(self, slot: int) -> bytes:
        """Forget a READY block (evicted, corrupt, or replaced); its slot becomes free."""
        key = self._key_in_state(slot, READY)
        if self.pins[slot]:
            raise TieredKVError(f"{self.name}: slot {slot} is pinned ({self.pins[slot]}) and cannot be dropped")
        del self.ready[key]
        self.policy.remove(slot)
        self.detached.discard(slot)
        self._release(slot)
        return key

    def evict(self, n: int) -> list[int]:
        """Choose exactly n unpinned READY victims (still READY, out of the policy), or []."""
        if n <= 0 or n > self.evictable:
            return []
        victims = self.policy.evict(n, self._protected)
        self.detached.update(victims)
        return victims

    # -- pins ------------------------------------------------------------------------
    def pin(self, slot: int) -> None:
        pins = self.pins
        if pins[slot] == 0 and self.state[slot] == READY and slot not in self.detached:
            self.pinned_ready += 1
        pins[slot] += 1

    def unpin(self, slot: int) -> int:
        pins = self.pins
        left = pins[slot] - 1
        if left < 0:
            raise TieredKVError(f"{self.name}: unpin of slot {slot} that is not pinned")
        pins[slot] = left
        if left == 0 and self.state[slot] == READY and slot not in self.detached:
            self.pinned_ready -= 1
        return left

    def touch(self, slot: int) -> None:
        self.policy.touch(slot)

    # -- restore after restart ---------------------------------------------------------
    def restore(self, entries: list[tuple[bytes, int]]) -> None:
        """Re-insert blocks recovered from persistent storage, oldest first, into an empty index."""
        if self.ready or self.pending:
            raise TieredKVError(f"{self.name}: restore needs an empty index")
        used = set()
        for key, slot in entries:
            if not 0 <= slot < self.num_slots or slot in used or key in self.ready:
                raise TieredKVError(f"{self.name}: recovered slot {slot} is out of range or used twice")
            used.add(slot)
            self.state[slot] = READY
            self.slot_key[slot] = key
            self.ready[key] = slot
            self.policy.insert(slot, key)
        self._free = array("i", (s for s in range(self.num_slots - 1, -1, -1) if s not in used))

    # -- internals ---------------------------------------------------------------------
    def _key_in_state(self, slot: int, expected: int) -> bytes:
        key = self.slot_key[slot]
        if key is None or self.state[slot] != expected:
            raise TieredKVError(
                f"{self.name}: slot {slot} is in state {self.state[slot]}, expected {expected}"
            )
        return key

    def _release(self, slot: int) -> None:
        self.state[slot] = FREE
        self.slot_key[slot] = None
        self._free.append(slot)

    def check_invariants(self) -> None:
        """Every slot accounted for exactly once (used by tests)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise TieredKVError(f"{self.name}: a slot is on the free list twice")
        for slot in range(self.num_slots):
            st, key = self.state[slot], self.slot_key[slot]
            if st == FREE:
                ok = slot in free and key is None and self.pins[slot] == 0
            elif st == RESERVED:
                ok = slot not in free and key is not None and self.pending.get(key) == slot
            else:
                ok = slot not in free and key is not None and self.ready.get(key) == slot
            if not ok:
                raise TieredKVError(f"{self.name}: slot {slot} state {st} is inconsistent")
        if len(self.ready) + len(self.pending) + len(free) != self.num_slots:
            raise TieredKVError(f"{self.name}: slots do not add up")
