"""One tier's bookkeeping: key -> slot, slot states, pins, free slots and the eviction policy.

All of it lives in the native core (native/tier.hpp): ``TierIndex`` is the core's ``Tier`` with a
few Python conveniences, so every batch operation below is one native call with no Python object
per block. Synchronous, loop-thread only, so it needs no locks.

States: FREE -> RESERVED (a copy into the slot is in flight) -> READY
(servable, tracked by the policy or the cold list) -> FREE. A READY slot with pins > 0 is being
read and is never evicted; an evicted slot leaves the policy at once and is
either dropped or handed to a new key by ``reassign`` (its old bytes may still
be read by a spill that the new key's copy waits for).

The cold list holds READY blocks that are worth less than anything the policy
orders: a copy that also lives in a faster tier (promoted, or loaded by an
engine that stores it back on eviction), or the tail of a released session.
It is evicted first, oldest first, and its victims are dropped, never spilled.
A touch takes a block out of it again.

Core methods (each takes a batch; slots are 1-D integer arrays, keys a list of ``bytes`` or a
``uint8[n, key_bytes]`` array): ``find``/``find_ready`` (slot per key, -1 if absent / not READY),
``reserve(keys)`` (ascending free slots for the leading keys that fit, RESERVED), ``reassign``,
``commit`` (READY, the LAST slot most recent), ``abort``, ``drop``, ``evict(n)`` (exactly n or none;
``evicted_cold`` leading ones from the cold list), ``demote(slots, loaded=False)``, ``pin``,
``unpin``, ``touch``, ``restore``; counters ``free_count``, ``n_ready``, ``n_reserved``,
``n_ready_pinned``, ``evictable``. A call that is refused raises before it changes anything.
"""

from __future__ import annotations

import numpy as np

from ..core import core, seeds
from ..errors import ConfigError, TieredKVError
from ..policy import HIGH, KINDS, LOW, START

FREE, RESERVED, READY = core.FREE, core.RESERVED, core.READY
EMPTY = np.empty(0, dtype=np.int64)


class TierKeys:
    """The tier's key table, as the manager reads it: ``slot_keys`` rows, ``find``, ``keys_of``."""

    __slots__ = ("_tier", "slot_keys", "find", "keys_of", "key_tags", "has_key")

    def __init__(self, tier: TierIndex) -> None:
        self._tier = tier
        self.slot_keys = tier.keys_view()  # uint8[num_slots, key_bytes]; rows of empty slots are stale
        self.find, self.keys_of, self.key_tags, self.has_key = tier.find, tier.keys_of, tier.key_tags, tier.has_key

    def __len__(self) -> int:
        return self._tier.n_keys

    def key_of(self, slot: int) -> bytes:
        return self.keys_of(np.array([slot]))[0]


class PolicyView:
    """What the tier's policy shows (its lists live in the core): name, sizes, ghosts, order."""

    __slots__ = ("_tier",)

    def __init__(self, tier: TierIndex) -> None:
        self._tier = tier

    @property
    def name(self) -> str:
        return self._tier.policy_name

    def __len__(self) -> int:
        return self._tier.policy_len

    def order(self) -> list[int]:
        return self._tier.policy_order()

    def list_sizes(self) -> tuple[int, int]:
        return self._tier.list_sizes()

    def ghost_sizes(self) -> tuple[int, int]:
        return self._tier.ghost_sizes()

    @property
    def p(self) -> float:
        return self._tier.p

    target = p


class TierIndex(core.Tier):
    """Slots of one tier; the eviction policy orders its READY, unpinned slots."""

    def __init__(self, name: str, num_slots: int, key_bytes: int, policy: str = "lru", *,
                 key_seeds: bytes | None = None) -> None:  # fmt: skip
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise TieredKVError(f"tier {name!r} needs at least one slot, got {num_slots!r}")
        kind = policy_kind(policy)
        # Tiers of one hierarchy share key_seeds: a key's tag (its history's identity) is the same in each.
        super().__init__(name, num_slots, key_bytes, kind, key_seeds or seeds(), START, LOW, HIGH)
        self.state = self.state_view()  # uint8 per slot (FREE / RESERVED / READY); read-only by convention
        self.pins = self.pins_view()  # uint16 pin count per slot
        self.keys = TierKeys(self)
        self.policy = PolicyView(self)

    @property
    def used(self) -> int:
        return self.num_slots - self.free_count

    def resident(self) -> dict[bytes, int]:
        """READY key -> slot, as a dict (O(n) Python objects: for tests and debugging only)."""
        slots = np.flatnonzero(self.state == READY)
        return dict(zip(self.keys_of(slots), slots.tolist(), strict=True))

    def nbytes(self) -> int:
        """Bytes the core holds for this tier (keys, table, states, pins, lists, ghosts)."""
        return self.core_nbytes


def policy_kind(policy: str) -> int:
    kind = KINDS.get(policy.lower()) if isinstance(policy, str) else None
    if kind is None:
        raise ConfigError(f"eviction.policy: unknown policy {policy!r}; allowed: {', '.join(KINDS)}")
    return kind


def join_hierarchy(policy: str, cpu_slots: int, disk_slots: int, key_bytes: int) -> tuple[TierIndex, TierIndex, object]:
    """A CPU tier and the disk tier below it under one policy (native/domain.hpp): a key's recency,
    frequency and ghosts follow it between the tiers; the policy picks what spills and what leaves.

    The tiers' own policies stay empty (LRU, no ghosts); each tier holds the domain and the other tier,
    so none of the three outlives what its native pointers refer to."""
    kind = policy_kind(policy)
    key_seeds = seeds()
    cpu = TierIndex("cpu", cpu_slots, key_bytes, "lru", key_seeds=key_seeds)
    disk = TierIndex("disk", disk_slots, key_bytes, "lru", key_seeds=key_seeds)
    domain = core.Domain(kind, cpu_slots, disk_slots, key_seeds, START, LOW, HIGH)
    domain.attach(cpu, disk)
    cpu.hierarchy, disk.hierarchy = (domain, disk), (domain, cpu)
    return cpu, disk, domain
