"""Reference model of a tier that is part of a hierarchy (native/tier.hpp with a Domain attached).

The tier keeps its states, pins, keys and cold list; its blocks' order, ghosts and history are the
domain's (domain.py). ``DomainView`` stands where a standalone tier has its policy, so the reference
TierIndex's own code (check_invariants) runs unchanged over the hierarchy's order.
"""

from __future__ import annotations

import numpy as np

from tiered_kv.errors import TieredKVError

from .domain import T1, T2, Domain
from .inputs import check_distinct_slots
from .tier_index import EMPTY, READY, RESERVED, TierIndex


class DomainView:
    """One tier's blocks in the hierarchy's policy, in slot numbers (what ``TierIndex.policy`` offers)."""

    def __init__(self, tier: DomainTier) -> None:
        self.tier = tier

    @property
    def name(self) -> str:
        return self.tier.domain.kind

    @property
    def p(self) -> float:
        return self.tier.domain.p

    target = p

    def _mine(self, nodes) -> list[int]:
        t = self.tier
        return [x - t.base for x in nodes if (x >= t.domain.split) == (t.level == 1)]

    def _ready(self, lst: int) -> int:
        """Members of list lst that are this tier's READY blocks (the native tier's mirror list)."""
        t = self.tier
        return sum(1 for s in self._mine(t.domain.lists[lst]) if t.state[s] == READY)

    def order(self) -> list[int]:
        """This tier's nodes in the hierarchy's eviction order, blocks in flight down included (as native)."""
        return self._mine(self.tier.domain.order())

    def __len__(self) -> int:
        return self._ready(T1) + self._ready(T2)

    def list_sizes(self) -> tuple[int, int]:
        return self._ready(T1), self._ready(T2)

    def ghost_sizes(self) -> tuple[int, int]:
        g = self.tier.domain.ghosts
        return len(g[0]), len(g[1])

    def insert(self, slots: np.ndarray) -> None:
        self.tier.policy_insert(slots)

    def remove(self, slots: np.ndarray) -> None:
        for s in np.asarray(slots).tolist():
            self.tier.domain.unlink(self.tier.node(s))

    def evict(self, n: int, pins: np.ndarray | None = None) -> np.ndarray:
        return self.tier.domain_evict(n)

    @property
    def nbytes(self) -> int:
        return 0


class DomainTier(TierIndex):
    """A reference tier attached to a Domain at ``level`` 0 (CPU) or 1 (disk); ``other``: the other tier."""

    def __init__(self, name: str, num_slots: int, key_bytes: int, domain: Domain, level: int) -> None:
        super().__init__(name, num_slots, key_bytes, "lru")
        self.domain, self.level = domain, level
        self.base = 0 if level == 0 else domain.split
        self.other: DomainTier | None = None
        self.policy = DomainView(self)

    def node(self, slot: int) -> int:
        return self.base + int(slot)

    def _tag(self, slot: int) -> int:
        return int(self.keys.key_tags(np.array([slot]))[0])

    def row_tag(self, row: np.ndarray) -> int:
        """The key's tag, as key_tags computes it for a slot holding it."""
        return int(_row_tags(self.keys, row[None, :])[0])

    # -- the policy, through the domain ------------------------------------------------------
    def policy_insert(self, slots) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots):
            self._expect(slots, READY)
            check_distinct_slots(slots, "policy_insert")
            for s in slots.tolist():  # a slot in the cold list and the policy's would break both
                if self.cold.stamp_of(np.array([s]))[0] >= 0 or self.domain.lid(self.node(s)):
                    raise TieredKVError(f"{self.name}: policy_insert of slot {s}, which is in a list already")
        nodes = [self.node(s) for s in slots.tolist()]
        for s, x in zip(np.asarray(slots).tolist(), nodes, strict=True):
            self.domain.tags[x] = self._tag(s)
        self.domain.insert(nodes)

    def candidate(self, node: int, only: int | None = None) -> bool:
        """READY and unpinned in its tier (``only``: and in that level's tier)."""
        level = int(node >= self.domain.split)
        if only is not None and level != only:
            return False
        tier = self if level == self.level else self.other
        s = node - tier.base
        return bool(tier.state[s] == READY and tier.pins[s] == 0)

    def domain_evict(self, n: int) -> np.ndarray:
        got = self.domain.evict(n, lambda x: self.candidate(x, self.level))
        if got is None:
            raise TieredKVError(f"{self.name}: {self.evictable} evictable slots counted but fewer found")
        return np.array([x - self.base for x in got], dtype=np.int64)

    # -- the tier's calls that read or change the order -----------------------------------
    def commit(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        self._expect(slots, RESERVED)
        self.state[slots] = READY
        self.n_reserved -= len(slots)
        self.n_ready += len(slots)
        self.n_ready_pinned += int(np.count_nonzero(self.pins[slots]))
        fresh = []
        for s in np.asarray(slots).tolist():
            if self.domain.lid(self.node(s)):
                continue  # a spill landed: it kept its rank
            if self.level == 1 and self.other is not None and self.other.keys.find(self.keys.slot_keys[[s]])[0] >= 0:
                self.cold.insert(np.array([s]))  # a written-through copy of a block the CPU holds
            else:
                fresh.append(s)
        self.policy_insert(np.array(fresh, dtype=np.int64))

    def abort(self, slots: np.ndarray) -> None:
        if len(slots):
            self._expect(slots, RESERVED)
            if not np.any(self.pins[slots]):
                for s in np.asarray(slots).tolist():
                    self.domain.unlink(self.node(s))  # a spill that failed
        super().abort(slots)

    def evict(self, n: int) -> np.ndarray:
        self.evicted_cold = 0
        if n <= 0 or n > self.evictable:
            return EMPTY
        return self._evict_cold_then(n, self.domain_evict)

    def demote(self, slots: np.ndarray, *, loaded: bool = False) -> None:
        slots = slots[self.state[slots] == READY] if len(slots) else slots
        if not len(slots):
            return
        slots = slots[self.cold.stamp_of(slots) < 0]
        check_distinct_slots(slots, "demote")  # before anything changes, as the native core
        for s in slots.tolist():
            if self.domain.lid(self.node(s)):
                self.domain.unlink(self.node(s))
                if loaded:
                    self.domain.hot(self._tag(s))  # its history goes with the block
        self.cold.insert(slots)

    def touch(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        if len(self.cold):
            cold = slots[self.cold.stamp_of(slots) >= 0]
            if len(cold):
                cold = np.unique(cold)
                self.cold.remove(cold)
                self.policy_insert(cold)
        self.domain.touch([self.node(s) for s in np.asarray(slots).tolist()])

    def restore(self, keys, slots: np.ndarray) -> None:
        saved, self.policy = self.policy, _Inserts(self)
        try:
            super().restore(keys, slots)
        finally:
            self.policy = saved

    def note(self, rows: np.ndarray) -> None:
        """Keys neither tier holds (in any state): their reference goes to the history."""
        if not len(rows):
            return
        here, there = self.keys.find(rows), self.other.keys.find(rows)
        for i in np.flatnonzero((here < 0) & (there < 0)).tolist():
            self.domain.note(self.row_tag(rows[i]))

    # -- the CPU's room: one policy decides what moves down and what leaves -----------------
    def make_room(self, n: int, spill: bool):
        """native Tier::make_room: (victims, evicted_cold, clean, spill_cpu, spill_disk, gone_disk rows, dropped)."""
        if self.level != 0:
            raise TieredKVError(f"{self.name}: make_room needs the CPU tier of a hierarchy")
        below, dom = (self.other if spill else None), self.domain
        victims: list[int] = []
        spill_cpu: list[int] = []
        spill_disk: list[int] = []
        gone: list[np.ndarray] = []
        self.evicted_cold, clean = 0, 0
        n = min(n, self.evictable)
        if n > 0 and len(self.cold):
            victims = self.cold.evict_up_to(n, self.pins).tolist()
        self.evicted_cold = len(victims)
        unpinned_here = lambda x: x < dom.split and self.state[x] == READY and self.pins[x] == 0  # noqa: E731
        while len(victims) < n:
            picked = dom.select(1, unpinned_here)
            if not picked:
                break
            c = picked[0][0]
            if below is None:
                dom.evict_node(self.node(c))
                victims.append(c)
                continue
            key = self.keys.slot_keys[[c]]
            dup = int(below.find_ready(key)[0])
            held_below = int(below.keys.find(key)[0]) >= 0
            if held_below and (dup < 0 or below.cold.stamp_of(np.array([dup]))[0] < 0):
                # the disk holds the key with a rank (or a copy in flight) of its own: the CPU block
                # leaves as a clean drop, no ghost (native make_room)
                dom.unlink(self.node(c))
                victims.append(c)
                clean += 1
                continue
            if dup >= 0:  # a clean copy below takes its rank
                below.cold.remove(np.array([dup]))
                dom.replace(self.node(c), below.node(dup))
                victims.append(c)
                clean += 1
                continue
            if below.free_count > 0:
                d = int(below.reserve(key)[0])
            else:
                cold = below.cold.evict_up_to(1, below.pins) if len(below.cold) else EMPTY
                if len(cold):
                    d = int(cold[0])
                else:
                    v = dom.evict(1, self.candidate)
                    if v is None:
                        break  # nothing unpinned anywhere
                    if v[0] < dom.split:  # a CPU block leaves: its slot is the room
                        victims.append(v[0])
                        continue
                    d = v[0] - dom.split
                gone.append(below.keys.slot_keys[d].copy())
                below.reassign(np.array([d]), key)
            dom.replace(self.node(c), below.node(d))  # in flight down, keeping its rank
            spill_cpu.append(c)
            spill_disk.append(d)
            victims.append(c)
        rows = np.array(gone, dtype=np.uint8).reshape(len(gone), self.keys.key_bytes)
        arr = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
        dropped = [v for v in victims if v not in spill_cpu]
        return arr(victims), self.evicted_cold, clean, arr(spill_cpu), arr(spill_disk), rows, arr(dropped)

    def check_invariants(self) -> None:
        """The standalone checks over READY blocks; a node of this tier in the lists is READY, or
        RESERVED in the disk tier (a spill in flight that keeps its rank)."""
        for s in self.policy.order():
            if self.state[s] != READY and not (self.level == 1 and self.state[s] == RESERVED):
                raise TieredKVError(f"{self.name}: slot {s} in state {int(self.state[s])} is in the hierarchy's lists")
        saved, self.policy = self.policy, _ReadyOrder(self.policy)
        try:
            super().check_invariants()
        finally:
            self.policy = saved


class _Inserts:
    """What TierIndex.restore calls on its policy, routed to the domain."""

    def __init__(self, tier: DomainTier) -> None:
        self.insert = tier.policy_insert


class _ReadyOrder:
    """The tier's READY blocks in the hierarchy's order (TierIndex.check_invariants' view)."""

    def __init__(self, view: DomainView) -> None:
        self._view = view

    def order(self) -> list[int]:
        return [s for s in self._view.order() if self._view.tier.state[s] == READY]


def _row_tags(keys, rows: np.ndarray) -> np.ndarray:
    """KeyTable.key_tags for key rows rather than slots (the same keyed hash)."""
    pad = -keys.key_bytes % 8
    words = np.pad(rows, ((0, 0), (0, pad))).view("<u8")
    h = np.full(len(rows), keys._s1, dtype=np.uint64)
    for w in words.T:
        h = (h ^ w) * keys._s2
        h ^= h >> np.uint64(32)
    return h


def join_hierarchy(policy: str, cpu_slots: int, disk_slots: int, key_bytes: int) -> tuple[DomainTier, DomainTier, Domain]:
    """The reference twin of tiered_kv.manager.tier_index.join_hierarchy."""
    domain = Domain(policy, cpu_slots, disk_slots)
    cpu = DomainTier("cpu", cpu_slots, key_bytes, domain, 0)
    disk = DomainTier("disk", disk_slots, key_bytes, domain, 1)
    disk.keys._s1, disk.keys._s2 = cpu.keys._s1, cpu.keys._s2  # one tag per key across the tiers
    cpu.other, disk.other = disk, cpu
    return cpu, disk, domain
