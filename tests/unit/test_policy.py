"""Eviction policies: order, the atomic evict contract, ARC adaptation, memory per slot."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiered_kv.errors import ConfigError
from tiered_kv.policy import POLICIES, ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def never(_slot: int) -> bool:
    return False


def key(i: int) -> bytes:
    return i.to_bytes(8, "little", signed=True)


def filled(name: str, num_slots: int, count: int | None = None) -> EvictionPolicy:
    pol = make_policy(name, num_slots)
    for s in range(num_slots if count is None else count):
        pol.insert(s, key(s))
    return pol


def snapshot(pol: EvictionPolicy) -> tuple:
    state: tuple = (pol.order(), len(pol), [s in pol for s in range(16)])
    if isinstance(pol, ARCPolicy):
        state += (pol.p, pol.ghost_keys(), pol.list_sizes())
    return state


# ---------------------------------------------------------------- order


@pytest.mark.parametrize("name", POLICIES)
def test_inserts_then_touches_give_recency_order(name: str) -> None:
    pol = filled(name, 8, 5)
    assert pol.order() == [0, 1, 2, 3, 4]
    pol.touch(1)
    pol.touch(0)
    assert pol.order() == [2, 3, 4, 1, 0]
    assert pol.evict(2, never) == [2, 3]
    assert pol.order() == [4, 1, 0]
    assert len(pol) == 3


@pytest.mark.parametrize("name", POLICIES)
def test_touch_of_the_next_victim_moves_it_to_mru(name: str) -> None:
    pol = filled(name, 4)
    pol.touch(0)
    assert pol.order() == [1, 2, 3, 0]
    assert pol.evict(1, never) == [1]


def test_lru_evicts_a_prefix_from_its_tail_when_touched_last_block_first() -> None:
    pol = LRUPolicy(16)
    request = [3, 7, 1, 9]  # slots of blocks 0..3 of one request
    for slot in reversed(request):
        pol.insert(slot, key(slot))
    for slot in reversed(request):
        pol.touch(slot)
    assert pol.evict(2, never) == [9, 1]  # the last two blocks go first
    assert pol.order() == [7, 3]


# ---------------------------------------------------------------- atomic evict


def _with_history(name: str) -> EvictionPolicy:
    """A policy with T1 and T2 populated, ghosts in B1 and B2, and p > 0 (for ARC)."""
    pol = filled(name, 16, 12)
    for s in (4, 5, 6):
        pol.touch(s)
    freed = pol.evict(2, never)  # 0, 1 from T1 -> B1
    pol.insert(freed[0], key(0))  # B1 ghost hit: p rises
    pol.touch(freed[0])
    pol.evict(2, lambda s: s not in (4, 5))  # 4, 5 from T2 -> B2
    for s in range(12, 16):
        pol.insert(s, key(100 + s))
    return pol


@pytest.mark.parametrize("name", POLICIES)
def test_evict_with_too_few_evictable_changes_nothing(name: str) -> None:
    pol = _with_history(name)
    if isinstance(pol, ARCPolicy):
        assert pol.p > 0 and all(pol.ghost_sizes())
    before = snapshot(pol)
    tracked = [s for s in range(16) if s in pol]
    unprotected = set(tracked[::3])
    protected = lambda s: s not in unprotected  # noqa: E731
    assert pol.evict(len(unprotected) + 1, protected) == []
    assert snapshot(pol) == before
    victims = pol.evict(len(unprotected), protected)
    assert sorted(victims) == sorted(unprotected)
    assert len(pol) == len(tracked) - len(unprotected)
    assert all(s not in pol for s in victims)


@pytest.mark.parametrize("name", POLICIES)
def test_evict_returns_exactly_n_and_never_a_protected_slot(name: str) -> None:
    pol = filled(name, 16)
    pol.touch(3)
    pol.touch(8)
    protected = {0, 2, 3, 5, 11}
    victims = pol.evict(6, protected.__contains__)
    assert len(victims) == 6 and len(set(victims)) == 6
    assert not protected & set(victims)
    assert victims == [1, 4, 6, 7, 9, 10]  # LRU end first, skipping protected slots
    assert pol.evict(0, never) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        pol.evict(-1, never)


@pytest.mark.parametrize("name", POLICIES)
def test_evict_is_untouched_when_protected_raises(name: str) -> None:
    pol = _with_history(name)
    before = snapshot(pol)
    calls = []

    def boom(slot: int) -> bool:
        calls.append(slot)
        if len(calls) == 3:
            raise RuntimeError("index went away")
        return False

    with pytest.raises(RuntimeError):
        pol.evict(5, boom)
    assert snapshot(pol) == before


# ---------------------------------------------------------------- insert / remove / errors


@pytest.mark.parametrize("name", POLICIES)
def test_remove_and_reinsert(name: str) -> None:
    pol = filled(name, 6)
    pol.remove(2)
    assert 2 not in pol and len(pol) == 5
    assert pol.order() == [0, 1, 3, 4, 5]
    pol.remove(2)  # untracked: no-op
    pol.touch(2)  # untracked: no-op
    assert pol.order() == [0, 1, 3, 4, 5]
    pol.insert(2, key(2))
    assert pol.order() == [0, 1, 3, 4, 5, 2]
    pol.remove(5)  # the MRU end
    pol.remove(0)  # the LRU end
    assert pol.order() == [1, 3, 4, 2]
    assert pol.evict(4, never) == [1, 3, 4, 2] and len(pol) == 0 and pol.order() == []


@pytest.mark.parametrize("name", POLICIES)
def test_bad_slots_raise(name: str) -> None:
    pol = filled(name, 4, 2)
    with pytest.raises(ValueError, match="slot 1 is already tracked"):
        pol.insert(1, key(1))
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=f"slot {bad} out of range for a policy of 4 slots"):
            pol.insert(bad, key(bad))
        with pytest.raises(ValueError):
            pol.touch(bad)
        assert bad not in pol
    assert pol.order() == [0, 1]


def test_make_policy_names() -> None:
    assert POLICIES == ("lru", "arc")
    assert isinstance(make_policy("LRU", 4), LRUPolicy)
    assert isinstance(make_policy("Arc", 4), ARCPolicy)
    with pytest.raises(ConfigError, match=r"eviction\.policy.*'lfu'.*lru, arc"):
        make_policy("lfu", 4)
    with pytest.raises(ValueError, match="num_slots"):
        make_policy("lru", -1)
    empty = make_policy("arc", 0)
    assert len(empty) == 0 and empty.evict(1, never) == []


# ---------------------------------------------------------------- ARC behaviour


def _hits_with_scan(name: str) -> int:
    """Hot-set hits while a stream of one-time keys passes through a 100-slot tier."""
    pol = make_policy(name, 100)
    where: dict[bytes, int] = {}
    free = list(range(100))
    hits = 0

    def access(k: bytes) -> bool:
        if k in where:
            pol.touch(where[k])
            return True
        if not free:
            (victim,) = pol.evict(1, never)
            del where[next(x for x, s in where.items() if s == victim)]
            free.append(victim)
        where[k] = free.pop()
        pol.insert(where[k], k)
        return False

    hot = [b"hot%d" % i for i in range(40)]
    for _ in range(2):
        for k in hot:
            access(k)
    for i in range(2000):
        access(b"scan%d" % i)
        if i % 10 == 0:
            hits += access(hot[(i // 10) % len(hot)])
    return hits


def test_arc_keeps_a_working_set_through_a_scan_that_flushes_lru() -> None:
    lru_hits, arc_hits = _hits_with_scan("lru"), _hits_with_scan("arc")
    assert arc_hits == 200  # every hot access hits
    assert lru_hits < 20


def test_arc_ghost_hits_move_p() -> None:
    pol = ARCPolicy(4)
    for s in range(4):
        pol.insert(s, key(s))
    assert pol.evict(1, never) == [0]
    assert pol.ghost_sizes() == (1, 0) and pol.p == 0
    pol.insert(0, key(0))  # B1 hit
    assert pol.p == 1 and pol.ghost_sizes() == (0, 0)
    assert pol.list_sizes() == (3, 1)  # straight into T2
    assert pol.evict(1, lambda s: s != 0) == [0]  # from T2 -> B2
    assert pol.ghost_sizes() == (0, 1)
    pol.insert(0, key(0))  # B2 hit
    assert pol.p == 0 and pol.list_sizes() == (3, 1)


def test_arc_p_moves_by_the_ghost_size_ratio() -> None:
    pol = ARCPolicy(16)
    for s in range(16):
        pol.insert(s, key(s))
    for s in range(12):
        pol.touch(s)
    assert pol.evict(12, lambda s: s >= 12) == list(range(12))  # T2 -> B2
    assert pol.evict(1, never) == [12]
    pol.insert(12, key(12))  # B1 hit with |B2| / |B1| = 12
    assert pol.p == 12

    pol = ARCPolicy(16)
    for s in range(16):
        pol.insert(s, key(s))
    pol.touch(14)
    pol.touch(15)
    assert pol.evict(2, lambda s: s < 14) == [14, 15]
    assert pol.evict(12, never) == list(range(12))
    for s in range(5):
        pol.insert(s, key(s))  # B1 hits, |B2| / |B1| < 1: +1 each
    assert pol.p == 5 and pol.ghost_sizes() == (7, 2)
    pol.insert(5, key(14))  # B2 hit with |B1| / |B2| = 3.5
    assert pol.p == 1.5


def test_arc_ghost_bound_holds_under_churn() -> None:
    pol = ARCPolicy(8)
    for s in range(8):
        pol.insert(s, key(s))
    for i in range(8, 500):
        (slot,) = pol.evict(1, never)
        pol.insert(slot, key(i % 37))  # recurring keys give ghost hits both ways
        if i % 3 == 0:
            pol.touch(slot)
        b1, b2 = pol.ghost_sizes()
        assert b1 + b2 <= 8 and 0 <= pol.p <= 8
    assert sum(pol.ghost_sizes()) == 8


# ---------------------------------------------------------------- reference models


class RefLRU:
    def __init__(self) -> None:
        self.lst: list[int] = []

    def insert(self, s: int, k: bytes) -> None:
        self.lst.append(s)

    def touch(self, s: int) -> None:
        if s in self.lst:
            self.lst.remove(s)
            self.lst.append(s)

    def remove(self, s: int) -> None:
        if s in self.lst:
            self.lst.remove(s)

    def evict(self, n: int, prot: frozenset[int]) -> list[int]:
        out = [s for s in self.lst if s not in prot][:n]
        if n == 0 or len(out) < n:
            return []
        for s in out:
            self.lst.remove(s)
        return out

    def order(self) -> list[int]:
        return list(self.lst)


class RefARC:
    """ARC as plain Python lists, written straight from the spec."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.keys: dict[int, bytes] = {}

    def insert(self, s: int, k: bytes) -> None:
        if k in self.b1:
            self.p = min(self.c, self.p + max(1.0, len(self.b2) / len(self.b1)))
            self.b1.remove(k)
            self.t2.append(s)
        elif k in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self.b2.remove(k)
            self.t2.append(s)
        else:
            self.t1.append(s)
        self.keys[s] = k

    def touch(self, s: int) -> None:
        if s in self.keys:
            self.remove(s, keep_key=True)
            self.t2.append(s)

    def remove(self, s: int, keep_key: bool = False) -> None:
        for lst in (self.t1, self.t2):
            if s in lst:
                lst.remove(s)
        if not keep_key:
            self.keys.pop(s, None)

    def evict(self, n: int, prot: frozenset[int]) -> list[int]:
        c1 = [s for s in self.t1 if s not in prot]
        c2 = [s for s in self.t2 if s not in prot]
        size1, out = len(self.t1), []
        while len(out) < n:
            if c1 and (size1 > self.p or not c2):
                out.append(c1.pop(0))
                size1 -= 1
            elif c2:
                out.append(c2.pop(0))
            else:
                return []
        for s in out:
            into, other = (self.b1, self.b2) if s in self.t1 else (self.b2, self.b1)
            k = self.keys[s]
            self.remove(s)
            for g in (into, other):
                if k in g:
                    g.remove(k)
            into.append(k)
            while len(into) + len(other) > self.c:
                (into if len(into) > len(other) else other).pop(0)
        return out

    def order(self) -> list[int]:
        saved = (self.t1[:], self.t2[:], self.b1[:], self.b2[:], dict(self.keys))
        out = self.evict(len(self.t1) + len(self.t2), frozenset())
        self.t1, self.t2, self.b1, self.b2, self.keys = saved
        return out


NSLOTS = 8
slots = st.integers(0, NSLOTS - 1)


class PolicyMachine(RuleBasedStateMachine):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.pol = make_policy(self.name, NSLOTS)
        self.ref: RefLRU | RefARC = RefLRU() if self.name == "lru" else RefARC(NSLOTS)
        self.tracked: set[int] = set()

    @rule(slot=slots, k=st.integers(0, 11))
    def insert(self, slot: int, k: int) -> None:
        if slot in self.tracked:
            with pytest.raises(ValueError):
                self.pol.insert(slot, key(k))
            return
        self.pol.insert(slot, key(k))
        self.ref.insert(slot, key(k))
        self.tracked.add(slot)

    @rule(slot=slots)
    def touch(self, slot: int) -> None:
        self.pol.touch(slot)
        self.ref.touch(slot)

    @rule(slot=slots)
    def remove(self, slot: int) -> None:
        self.pol.remove(slot)
        self.ref.remove(slot)
        self.tracked.discard(slot)

    @rule(n=st.integers(0, 5), prot=st.frozensets(slots, max_size=6))
    def evict(self, n: int, prot: frozenset[int]) -> None:
        before = snapshot(self.pol)
        got = self.pol.evict(n, prot.__contains__)
        assert got == self.ref.evict(n, prot)
        evictable = len(self.tracked - prot)
        if n == 0 or evictable < n:
            assert got == [] and snapshot(self.pol) == before
        else:
            assert len(got) == n == len(set(got)) and not set(got) & prot
            assert set(got) <= self.tracked
            self.tracked -= set(got)

    @invariant()
    def agrees(self) -> None:
        assert self.pol.order() == self.ref.order()
        assert len(self.pol) == len(self.tracked)
        assert {s for s in range(NSLOTS) if s in self.pol} == self.tracked
        if isinstance(self.pol, ARCPolicy):
            b1, b2 = self.pol.ghost_sizes()
            assert b1 + b2 <= NSLOTS and 0 <= self.pol.p <= NSLOTS
            assert self.pol.ghost_keys() == (self.ref.b1, self.ref.b2)
            assert self.pol.p == self.ref.p


class ARCMachine(PolicyMachine):
    name = "arc"


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUStateful = PolicyMachine.TestCase
TestLRUStateful.settings = _machine_settings
TestARCStateful = ARCMachine.TestCase
TestARCStateful.settings = _machine_settings


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize(("name", "limit"), [("lru", 40), ("arc", 60)])
def test_memory_per_slot_at_one_million_slots(name: str, limit: int) -> None:
    n = 1_000_000
    shared_key = b"k" * 16
    gc.collect()
    tracemalloc.start()
    try:
        pol = make_policy(name, n)
        insert = pol.insert
        for s in range(n):
            insert(s, shared_key)
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_slot = used / n
    print(f"{name}: {per_slot:.1f} bytes/slot at {n} slots")
    assert len(pol) == n
    assert per_slot < limit
