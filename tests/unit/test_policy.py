"""Eviction policies: batch order, the atomic evict contract, ARC adaptation, memory per slot."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from reference_core.policy.tagtable import TagTable

from tiered_kv.errors import ConfigError
from tiered_kv.replay.policies import (
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    WindowPolicy,
    make_policy,
)


def A(*slots: int) -> np.ndarray:
    return np.array(slots, dtype=np.int64)


def pins(num_slots: int, pinned: object = ()) -> np.ndarray:
    out = np.zeros(num_slots, dtype=np.uint32)
    out[list(pinned)] = 1
    return out


class SlotTags:
    """key_tag for the tests: the tag of the key each slot holds, written before the slot is inserted."""

    def __init__(self, num_slots: int) -> None:
        self.tags = np.zeros(num_slots, dtype=np.uint64)
        self.fail = False

    def __call__(self, slots: np.ndarray) -> np.ndarray:
        if self.fail:
            raise RuntimeError("key table went away")
        return self.tags[slots]

    def insert(self, pol: EvictionPolicy, slots: list[int], keys: list[int]) -> None:
        self.tags[slots] = keys
        pol.insert(np.array(slots, dtype=np.int64))


def build(name: str, num_slots: int) -> EvictionPolicy:
    """make_policy, but the window policy's target starts (and may stay) at 0 instead of 10 % of the slots.

    It then orders slots as ARC does (window FIFO first, then main LRU), which
    the recency contract tests below spell out; its default target is covered
    in test_policy_window.py.
    """
    return WindowPolicy(num_slots, start=0.0, low=0.0) if name == "window" else make_policy(name, num_slots)


def filled(name: str, num_slots: int, count: int | None = None) -> EvictionPolicy:
    pol = build(name, num_slots)
    pol.insert(np.arange(num_slots if count is None else count))
    return pol


def snapshot(pol: EvictionPolicy) -> tuple:
    state: tuple = (pol.order(), len(pol), [s in pol for s in range(16)])
    if isinstance(pol, ARCPolicy):
        state += (pol.p, pol.ghost_tags(), pol.list_sizes())
    return state


def evict(pol: EvictionPolicy, n: int, pinned: object = ()) -> list[int]:
    out = pol.evict(n, pins(pol.num_slots, pinned))
    assert out.dtype == np.int64 and out.ndim == 1
    return out.tolist()


# ---------------------------------------------------------------- order


@pytest.mark.parametrize("name", POLICIES)
def test_inserts_then_touches_give_recency_order(name: str) -> None:
    pol = filled(name, 8, 5)
    assert pol.order() == [0, 1, 2, 3, 4]
    pol.touch(A(1, 0))
    assert pol.order() == [2, 3, 4, 1, 0]
    assert evict(pol, 2) == [2, 3]
    assert pol.order() == [4, 1, 0]
    assert len(pol) == 3


@pytest.mark.parametrize("name", POLICIES)
def test_touch_of_the_next_victim_moves_it_to_mru(name: str) -> None:
    pol = filled(name, 4)
    pol.touch(A(0))
    assert pol.order() == [1, 2, 3, 0]
    assert evict(pol, 1) == [1]


@pytest.mark.parametrize("name", POLICIES)
def test_a_batch_acts_as_its_elements_in_order(name: str) -> None:
    batch, single = build(name, 10), build(name, 10)
    batch.insert(A(5, 2, 7, 0))
    for s in (5, 2, 7, 0):
        single.insert(A(s))
    touches = [2, 9, 5, 2, 0, 5]  # repeats, and 9 is not tracked (ignored)
    batch.touch(np.array(touches))
    for s in touches:
        single.touch(A(s))
    assert batch.order() == single.order() == [7, 2, 0, 5]
    batch.remove(A(2, 2, 3))
    assert batch.order() == [7, 0, 5] and len(batch) == 3


@pytest.mark.parametrize("name", POLICIES)
def test_a_request_inserted_last_block_first_loses_its_tail_first(name: str) -> None:
    pol = build(name, 16)
    r1, r2 = [3, 7, 1, 9], [0, 4]  # slots of blocks 0.. of two requests
    pol.insert(np.array(r1[::-1]))
    pol.insert(np.array(r2[::-1]))
    assert evict(pol, 2) == [9, 1]  # r1's last two blocks go first
    r1[2:] = [10, 11]  # stored again, in other slots
    pol.insert(A(11, 10))
    pol.touch(np.array(r1[::-1]))  # a hit on r1: its blocks touched last-block-first
    assert evict(pol, 3) == [4, 0, 11]  # r2 whole (tail first), then r1's tail
    assert pol.order() == [10, 7, 3]  # r1's leading blocks are the most recent


# ---------------------------------------------------------------- atomic evict


def _with_history(name: str) -> EvictionPolicy:
    """A policy with T1 and T2 populated, ghosts in B1 and B2, and p > 0 (for ARC)."""
    pol = filled(name, 16, 12)
    pol.touch(A(4, 5, 6))
    freed = evict(pol, 2)  # 0, 1 from T1 -> B1
    pol.insert(A(freed[0]))  # B1 ghost hit (the slot id is the tag): p rises
    pol.touch(A(freed[0]))
    assert evict(pol, 2, pinned=set(range(16)) - {4, 5}) == [4, 5]  # from T2 -> B2
    pol.insert(A(12, 13, 14, 15))
    return pol


@pytest.mark.parametrize("name", POLICIES)
def test_evict_with_too_few_evictable_changes_nothing(name: str) -> None:
    pol = _with_history(name)
    if isinstance(pol, ARCPolicy):
        assert pol.p > 0 and all(pol.ghost_sizes())
    before = snapshot(pol)
    tracked = [s for s in range(16) if s in pol]
    unpinned = set(tracked[::3])
    pinned = set(range(16)) - unpinned
    assert evict(pol, len(unpinned) + 1, pinned) == []
    assert snapshot(pol) == before
    victims = evict(pol, len(unpinned), pinned)
    assert sorted(victims) == sorted(unpinned)
    assert len(pol) == len(tracked) - len(unpinned)
    assert all(s not in pol for s in victims)
    assert evict(pol, len(pol) + 1) == []


@pytest.mark.parametrize("name", POLICIES)
def test_evict_returns_exactly_n_and_never_a_pinned_slot(name: str) -> None:
    pol = filled(name, 16)
    pol.touch(A(3))
    pol.touch(A(8))
    pinned = {0, 2, 3, 5, 11}
    victims = evict(pol, 6, pinned)
    assert len(victims) == 6 and len(set(victims)) == 6
    assert not pinned & set(victims)
    assert victims == [1, 4, 6, 7, 9, 10]  # LRU end first, skipping pinned slots
    assert evict(pol, 0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        pol.evict(-1, pins(16))


@pytest.mark.parametrize("name", POLICIES)
def test_pinned_slots_keep_their_place_in_the_order(name: str) -> None:
    pol = filled(name, 12, 10)
    assert evict(pol, 3, pinned={0, 1}) == [2, 3, 4]
    assert pol.order() == [0, 1, 5, 6, 7, 8, 9]
    pol.touch(A(7))
    assert evict(pol, 2, pinned={0}) == [1, 5]
    assert evict(pol, 1, pinned={0}) == [6]
    assert pol.order() == [0, 8, 9, 7]  # still the least recent once unpinned
    assert evict(pol, 2) == [0, 8]


@pytest.mark.parametrize("name", POLICIES)
def test_pins_must_be_one_count_per_slot(name: str) -> None:
    pol = filled(name, 4)
    before = snapshot(pol)
    for bad in (np.zeros(3, np.uint32), [0, 0, 0, 0], np.zeros((4, 1), np.uint32)):
        with pytest.raises(ValueError, match="pins must be an array of 4 pin counts"):
            pol.evict(1, bad)
    assert snapshot(pol) == before


def test_arc_insert_is_untouched_when_key_tag_raises() -> None:
    # The core keeps each slot's tag from its insert (evict reads no key), so insert is where it can fail.
    tags = SlotTags(16)
    pol = ARCPolicy(16, key_tag=tags)
    tags.insert(pol, list(range(12)), [100 + s for s in range(12)])
    pol.touch(A(4, 5))
    evict(pol, 3)
    before = snapshot(pol)
    tags.fail = True
    with pytest.raises(RuntimeError, match="key table went away"):
        pol.insert(A(12, 13))
    assert snapshot(pol) == before


# ---------------------------------------------------------------- insert / remove / errors


@pytest.mark.parametrize("name", POLICIES)
def test_remove_and_reinsert(name: str) -> None:
    pol = filled(name, 6)
    pol.remove(A(2))
    assert 2 not in pol and len(pol) == 5
    assert pol.order() == [0, 1, 3, 4, 5]
    pol.remove(A(2))  # untracked: no-op
    pol.touch(A(2))  # untracked: no-op
    assert pol.order() == [0, 1, 3, 4, 5]
    pol.insert(A(2))
    assert pol.order() == [0, 1, 3, 4, 5, 2]
    pol.remove(A(5, 0))  # the MRU end and the LRU end
    assert pol.order() == [1, 3, 4, 2]
    assert evict(pol, 4) == [1, 3, 4, 2] and len(pol) == 0 and pol.order() == []


@pytest.mark.parametrize("name", POLICIES)
def test_bad_slots_raise_and_change_nothing(name: str) -> None:
    pol = filled(name, 4, 2)
    before = snapshot(pol)
    with pytest.raises(ValueError, match="slot 1 is already tracked"):
        pol.insert(A(2, 1))
    with pytest.raises(ValueError, match="slot 3 appears twice in one insert batch"):
        pol.insert(A(3, 2, 3))
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=f"slot {bad} out of range for a policy of 4 slots"):
            pol.insert(A(2, bad))
        with pytest.raises(ValueError, match=f"slot {bad} out of range"):
            pol.touch(A(0, bad))
        with pytest.raises(ValueError, match=f"slot {bad} out of range"):
            pol.remove(A(bad))
        assert bad not in pol
    with pytest.raises(ValueError, match="1-D"):
        pol.touch(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="integers"):
        pol.touch(np.array([0.5]))
    assert snapshot(pol) == before
    pol.insert(A(2, 3))  # the refused slots are still free to insert
    assert pol.order() == [0, 1, 2, 3]


def test_make_policy_names() -> None:
    assert POLICIES == ("lru", "arc", "window")
    assert isinstance(make_policy("LRU", 4), LRUPolicy)
    assert isinstance(make_policy("Arc", 4), ARCPolicy)
    assert isinstance(make_policy("Window", 4), WindowPolicy)
    with pytest.raises(ConfigError, match=r"eviction\.policy.*'lfu'.*lru, arc, window"):
        make_policy("lfu", 4)
    with pytest.raises(ValueError, match="num_slots"):
        make_policy("lru", -1)
    empty = make_policy("arc", 0)
    assert len(empty) == 0 and evict(empty, 1) == []
    tags = SlotTags(4)
    pol = make_policy("arc", 4, key_tag=tags)
    tags.insert(pol, [0], [77])
    evict(pol, 1)
    assert pol.ghost_tags() == ([77], [])  # make_policy handed key_tag over
    assert isinstance(make_policy("lru", 4, key_tag=tags), LRUPolicy)


@pytest.mark.parametrize("name", POLICIES)
def test_the_log_compacts_without_losing_order(name: str) -> None:
    pol = filled(name, 4)
    pol.touch(np.arange(4))  # for ARC: all in T2, where the order is plain recency
    ref = [0, 1, 2, 3]
    rng = np.random.default_rng(7)
    for _ in range(300):  # ~100x the log's length in appends
        batch = rng.integers(0, 4, 3)
        pol.touch(batch)
        for s in batch.tolist():
            ref.remove(s)
            ref.append(s)
        assert pol.order() == ref
    many = rng.integers(0, 4, 1000)  # one batch longer than the log itself
    pol.touch(many)
    last = {s: i for i, s in enumerate(many.tolist())}
    assert pol.order() == sorted(last, key=last.__getitem__)
    assert len(pol) == 4


# ---------------------------------------------------------------- ARC behaviour


def _hits_with_scan(name: str) -> int:
    """Hot-set hits while a stream of one-time keys passes through a 100-slot tier."""
    tags = SlotTags(100)
    pol = make_policy(name, 100, key_tag=tags)
    where: dict[str, int] = {}
    ids: dict[str, int] = {}
    free = list(range(100))
    hits = 0

    def access(k: str) -> bool:
        if k in where:
            pol.touch(A(where[k]))
            return True
        if not free:
            (victim,) = evict(pol, 1)
            del where[next(x for x, s in where.items() if s == victim)]
            free.append(victim)
        where[k] = free.pop()
        tags.insert(pol, [where[k]], [ids.setdefault(k, len(ids))])
        return False

    hot = [f"hot{i}" for i in range(40)]
    for _ in range(2):
        for k in hot:
            access(k)
    for i in range(2000):
        access(f"scan{i}")
        if i % 10 == 0:
            hits += access(hot[(i // 10) % len(hot)])
    return hits


def test_arc_keeps_a_working_set_through_a_scan_that_flushes_lru() -> None:
    lru_hits, arc_hits = _hits_with_scan("lru"), _hits_with_scan("arc")
    assert arc_hits == 200  # every hot access hits
    assert lru_hits < 20


def test_arc_ghost_hits_move_p() -> None:
    tags = SlotTags(4)
    pol = ARCPolicy(4, key_tag=tags)
    tags.insert(pol, [0, 1, 2, 3], [10, 11, 12, 13])
    assert evict(pol, 1) == [0]
    assert pol.ghost_tags() == ([10], []) and pol.p == 0
    tags.insert(pol, [0], [10])  # B1 hit
    assert pol.p == 1 and pol.ghost_sizes() == (0, 0)
    assert pol.list_sizes() == (3, 1)  # straight into T2
    assert evict(pol, 1, pinned={1, 2, 3}) == [0]  # from T2 -> B2
    assert pol.ghost_tags() == ([], [10])
    tags.insert(pol, [0], [10])  # B2 hit
    assert pol.p == 0 and pol.list_sizes() == (3, 1)


def test_arc_ghosts_hold_key_tags_not_slots() -> None:
    tags = SlotTags(8)
    pol = ARCPolicy(8, key_tag=tags)
    tags.insert(pol, [0, 1, 2], [500, 501, 502])
    assert evict(pol, 2) == [0, 1]
    tags.insert(pol, [0], [900])  # slot 0 back with another key: not a ghost hit
    assert pol.list_sizes() == (2, 0) and pol.ghost_tags() == ([500, 501], [])
    tags.insert(pol, [5], [501])  # key 501 back in another slot: a B1 hit
    assert pol.list_sizes() == (2, 1) and pol.ghost_tags() == ([500], []) and pol.p == 1
    top = 2**64 - 1  # any uint64 is a tag (the core reserves none)
    tags.insert(pol, [6], [top])
    assert evict(pol, 4) == [2, 0, 5, 6]  # T1 down to p = 1, then T2, then T1 again
    assert pol.ghost_tags() == ([500, 502, 900, top], [501])
    tags.insert(pol, [7], [top])
    assert pol.ghost_tags() == ([500, 502, 900], [501]) and pol.list_sizes() == (0, 1)


def test_arc_p_moves_by_the_ghost_size_ratio() -> None:
    tags = SlotTags(16)
    pol = ARCPolicy(16, key_tag=tags)
    tags.insert(pol, list(range(16)), list(range(16)))
    pol.touch(np.arange(12))
    assert evict(pol, 12, pinned=range(12, 16)) == list(range(12))  # T2 -> B2
    assert evict(pol, 1) == [12]
    tags.insert(pol, [12], [12])  # B1 hit with |B2| / |B1| = 12
    assert pol.p == 12

    pol = ARCPolicy(16, key_tag=tags)
    tags.insert(pol, list(range(16)), list(range(16)))
    pol.touch(A(14, 15))
    assert evict(pol, 2, pinned=range(14)) == [14, 15]
    assert evict(pol, 12) == list(range(12))
    tags.insert(pol, list(range(5)), list(range(5)))  # B1 hits, |B2| / |B1| < 1: +1 each
    assert pol.p == 5 and pol.ghost_sizes() == (7, 2)
    tags.insert(pol, [5], [14])  # B2 hit with |B1| / |B2| = 3.5
    assert pol.p == 1.5


def test_arc_ghost_bound_holds_under_churn() -> None:
    tags = SlotTags(8)
    pol = ARCPolicy(8, key_tag=tags)
    tags.insert(pol, list(range(8)), list(range(8)))
    for i in range(8, 500):
        slots = evict(pol, 2)
        tags.insert(pol, slots, [i % 37, (i * 7) % 41])  # recurring keys give ghost hits both ways
        if i % 3 == 0:
            pol.touch(np.array(slots))
        b1, b2 = pol.ghost_sizes()
        assert b1 + b2 <= 8 and 0 <= pol.p <= 8
    assert sum(pol.ghost_sizes()) == 8


def test_arc_trims_ghosts_one_add_at_a_time_within_a_batch() -> None:
    tags = SlotTags(2)
    pol = ARCPolicy(2, key_tag=tags)
    tags.insert(pol, [0, 1], [10, 11])
    pol.touch(A(0, 1))
    assert evict(pol, 2) == [0, 1] and pol.ghost_tags() == ([], [10, 11])  # B2 at the bound
    tags.insert(pol, [0, 1], [20, 21])
    assert evict(pol, 2) == [0, 1]
    # Adding 20 trims the longer B2 (10 goes); adding 21 then trims B1, the longer: 20 goes.
    assert pol.ghost_tags() == ([21], [11])


def test_tag_table_agrees_with_a_dict_under_churn() -> None:
    """Inserts, deletes and lookups at half load: buckets overflow into the next and tombstones rebuild."""
    table, ref = TagTable(64, 1000), {}
    rng = np.random.default_rng(3)
    universe = rng.integers(0, 2**64 - 1, 200, dtype=np.uint64)
    spills = 0
    for step in range(3000):
        pick = np.unique(rng.choice(universe, 6))
        absent = np.array([t for t in pick.tolist() if t not in ref], dtype=np.uint64)
        room = 64 - len(ref)
        if absent.size and room:
            absent = absent[:room]
            vals = rng.integers(0, 1000, absent.size)
            table.insert(absent, vals)
            ref.update(zip(absent.tolist(), vals.tolist(), strict=True))
        gone = np.array([t for t in pick.tolist() if t in ref][: step % 4], dtype=np.uint64)
        table.delete(gone)
        for t in gone.tolist():
            del ref[t]
        got = table.find(universe)
        assert got.tolist() == [ref.get(t, -1) for t in universe.tolist()]
        assert table.live == len(ref)
        spills = max(spills, table._flags)
    assert spills > 0 and table.rebuilds > 0  # buckets overflowed, and the table rebuilt itself


# ---------------------------------------------------------------- reference models


class RefLRU:
    def __init__(self) -> None:
        self.lst: list[int] = []

    def insert(self, s: int, k: int) -> None:
        self.lst.append(s)

    def insert_batch(self, slots: list[int], keys: list[int]) -> None:
        self.lst.extend(slots)

    def touch(self, s: int) -> None:
        if s in self.lst:
            self.lst.remove(s)
            self.lst.append(s)

    def remove(self, s: int) -> None:
        if s in self.lst:
            self.lst.remove(s)

    def demote(self, s: int) -> None:
        self.remove(s)

    def evict(self, n: int, pinned: frozenset[int]) -> list[int]:
        out = [s for s in self.lst if s not in pinned][:n]
        if n == 0 or len(out) < n:
            return []
        for s in out:
            self.lst.remove(s)
        return out

    def order(self) -> list[int]:
        return list(self.lst)


class RefARC:
    """ARC as plain Python lists, written straight from the spec, one slot at a time."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []
        self.keys: dict[int, int] = {}

    def insert(self, s: int, k: int) -> None:
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

    def demote(self, s: int) -> None:
        self.remove(s)

    def evict(self, n: int, pinned: frozenset[int]) -> list[int]:
        c1 = [s for s in self.t1 if s not in pinned]
        c2 = [s for s in self.t2 if s not in pinned]
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
            self.trim(into, other)
        return out

    def trim(self, into: list[int], other: list[int]) -> None:
        while len(into) + len(other) > self.c:
            (into if len(into) > len(other) else other).pop(0)

    def insert_batch(self, slots: list[int], keys: list[int]) -> None:
        for s, k in zip(slots, keys, strict=True):
            self.insert(s, k)

    def order(self) -> list[int]:
        saved = (self.t1[:], self.t2[:], self.b1[:], self.b2[:], dict(self.keys))
        out = self.evict(len(self.t1) + len(self.t2), frozenset())
        self.t1, self.t2, self.b1, self.b2, self.keys = saved
        return out


class RefWindow(RefARC):
    """The adaptive window as ARC's lists (t1 = window, t2 = main) with its own target and ghost bounds.

    The target starts at a tenth of the slots and moves once per insert batch,
    one slot per ghost hit (up for the window's ghosts, down for main's), within
    [5 %, 20 %] of the slots; the window's ghosts keep at most 4x the slots,
    main's 2x. ``demote`` forgets a slot and makes its key main's newest ghost.
    """

    def __init__(self, c: int, start: float = 0.1, low: float = 0.05, high: float = 0.2) -> None:
        super().__init__(c)
        self.p, self.low, self.high = float(start * c), float(low * c), float(high * c)

    def insert_batch(self, slots: list[int], keys: list[int]) -> None:
        hits = [0, 0]
        for s, k in zip(slots, keys, strict=True):
            for lid, ghosts in enumerate((self.b1, self.b2)):
                if k in ghosts:
                    ghosts.remove(k)
                    hits[lid] += 1
                    self.t2.append(s)
                    break
            else:
                self.t1.append(s)
            self.keys[s] = k
        self.p = min(self.high, max(self.low, self.p + hits[0] - hits[1]))

    def trim(self, into: list[int], other: list[int]) -> None:
        for ghosts, bound in ((self.b1, 4 * self.c), (self.b2, 2 * self.c)):
            del ghosts[: max(0, len(ghosts) - bound)]

    def demote(self, s: int) -> None:
        if s not in self.t1 and s not in self.t2:
            return
        k = self.keys[s]
        self.remove(s)
        for g in (self.b1, self.b2):
            if k in g:
                g.remove(k)
        self.b2.append(k)
        self.trim(self.b2, self.b1)


def reference(name: str, n: int) -> RefLRU | RefARC:
    return RefLRU() if name == "lru" else RefARC(n) if name == "arc" else RefWindow(n)


WIDE = {"start": 0.5, "low": 0.0, "high": 1.0}  # a window target free to roam, so every move shows


@pytest.mark.parametrize("name", POLICIES)
def test_a_long_random_run_matches_the_reference(name: str) -> None:
    """Thousands of random batches: ghost lists fill and trim, logs compact, the tag table rebuilds."""
    n = 16
    rng = np.random.default_rng(11)
    tags = SlotTags(n)
    pol = WindowPolicy(n, key_tag=tags, **WIDE) if name == "window" else make_policy(name, n, key_tag=tags)
    ref = RefWindow(n, **WIDE) if name == "window" else reference(name, n)
    tracked: set[int] = set()
    at_bound, p_seen = 0, set()
    bounds = (4 * n, 2 * n) if name == "window" else None  # the window's ghost lists: one bound each
    universe = 12 * n if name == "window" else 40  # enough keys to reach the bounds, few enough for ghost hits
    for step in range(2500):
        op = rng.integers(0, 11)
        if op < 4:  # insert a few free slots with keys from a small universe: ghost hits both ways
            free = [s for s in range(n) if s not in tracked]
            batch = rng.permutation(free)[: rng.integers(0, 5)].tolist()
            keys = rng.integers(0, universe, len(batch)).tolist()
            tags.insert(pol, batch, keys)
            ref.insert_batch(batch, keys)
            tracked |= set(batch)
        elif op < 7:
            batch = rng.integers(0, n, rng.integers(0, 6)).tolist()
            pol.touch(np.array(batch, dtype=np.int64))
            for s in batch:
                ref.touch(s)
        elif op < 9:
            pinned = frozenset(rng.integers(0, n, rng.integers(0, 4)).tolist())
            k = int(rng.integers(0, 6))
            got = evict(pol, k, pinned)
            assert got == ref.evict(k, pinned), step
            tracked -= set(got)
        else:  # remove (drop) or demote (a hit moved up): the window remembers the latter
            batch = rng.integers(0, n, rng.integers(0, 3)).tolist()
            demote = op == 10
            (pol.demote if demote else pol.remove)(np.array(batch, dtype=np.int64))
            for s in batch:
                (ref.demote if demote else ref.remove)(s)
            tracked -= set(batch)
        assert pol.order() == ref.order(), step
        if isinstance(pol, ARCPolicy):
            assert isinstance(ref, RefARC)
            assert pol.ghost_tags() == (ref.b1, ref.b2) and pol.p == ref.p, step
            sizes = pol.ghost_sizes()
            at_bound += sizes[0] == bounds[0] or sizes[1] == bounds[1] if bounds else sum(sizes) == n
            p_seen.add(pol.p)
    if isinstance(pol, ARCPolicy):
        assert at_bound > 100 and len(p_seen) > 10  # the ghost bound was hit often, p adapted


NSLOTS = 8
slot_ids = st.integers(0, NSLOTS - 1)


class PolicyMachine(RuleBasedStateMachine):
    """Random batches against a one-slot-at-a-time reference: a batch must equal its elements in order."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.tags = SlotTags(NSLOTS)
        self.pol = make_policy(self.name, NSLOTS, key_tag=self.tags)
        self.ref = reference(self.name, NSLOTS)
        self.tracked: set[int] = set()

    @rule(batch=st.lists(st.tuples(slot_ids, st.integers(0, 11)), max_size=4, unique_by=lambda x: x[0]))
    def insert(self, batch: list[tuple[int, int]]) -> None:
        batch = [(s, k) for s, k in batch if s not in self.tracked]
        self.tags.insert(self.pol, [s for s, _ in batch], [k for _, k in batch])
        self.ref.insert_batch([s for s, _ in batch], [k for _, k in batch])
        self.tracked |= {s for s, _ in batch}

    @rule(batch=st.lists(slot_ids, min_size=1, max_size=4))
    def insert_refused(self, batch: list[int]) -> None:
        if len(set(batch)) == len(batch) and not self.tracked & set(batch):
            batch = batch + batch[:1]  # make it refused: a repeat
        before = snapshot(self.pol)
        with pytest.raises(ValueError):
            self.pol.insert(np.array(batch))
        assert snapshot(self.pol) == before

    @rule(batch=st.lists(slot_ids, max_size=6))
    def touch(self, batch: list[int]) -> None:
        self.pol.touch(np.array(batch, dtype=np.int64))
        for s in batch:
            self.ref.touch(s)

    @rule(batch=st.lists(slot_ids, max_size=4), moved_up=st.booleans())
    def remove(self, batch: list[int], moved_up: bool) -> None:
        """Dropped, or (``moved_up``) demoted after a hit took the block to a faster tier."""
        (self.pol.demote if moved_up else self.pol.remove)(np.array(batch, dtype=np.int64))
        for s in batch:
            (self.ref.demote if moved_up else self.ref.remove)(s)
            self.tracked.discard(s)

    @rule(n=st.integers(0, 5), pinned=st.frozensets(slot_ids, max_size=6))
    def evict(self, n: int, pinned: frozenset[int]) -> None:
        before = snapshot(self.pol)
        got = evict(self.pol, n, pinned)
        assert got == self.ref.evict(n, pinned)
        if n == 0 or len(self.tracked - pinned) < n:
            assert got == [] and snapshot(self.pol) == before
        else:
            assert len(got) == n == len(set(got)) and not set(got) & pinned
            assert set(got) <= self.tracked
            self.tracked -= set(got)

    @invariant()
    def agrees(self) -> None:
        assert self.pol.order() == self.ref.order()
        assert len(self.pol) == len(self.tracked)
        assert {s for s in range(NSLOTS) if s in self.pol} == self.tracked
        if isinstance(self.pol, ARCPolicy):
            assert isinstance(self.ref, RefARC)
            b1, b2 = self.pol.ghost_sizes()
            assert b1 + b2 <= (6 if self.name == "window" else 1) * NSLOTS and 0 <= self.pol.p <= NSLOTS
            assert self.pol.ghost_tags() == (self.ref.b1, self.ref.b2)
            assert self.pol.list_sizes() == (len(self.ref.t1), len(self.ref.t2))
            assert self.pol.p == self.ref.p


class ARCMachine(PolicyMachine):
    name = "arc"


class WindowMachine(PolicyMachine):
    name = "window"


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUStateful = PolicyMachine.TestCase
TestLRUStateful.settings = _machine_settings
TestARCStateful = ARCMachine.TestCase
TestARCStateful.settings = _machine_settings
TestWindowStateful = WindowMachine.TestCase
TestWindowStateful.settings = _machine_settings


# ---------------------------------------------------------------- memory


def _traced(build: Callable[[int], EvictionPolicy], n: int) -> tuple[EvictionPolicy, int]:
    """The policy ``build(n)`` makes and the bytes still allocated after it (tracemalloc)."""
    build(5000)  # first: lazy imports and caches of the calls it makes are not the policy's
    gc.collect()
    tracemalloc.start()
    try:
        pol = build(n)
        gc.collect()
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return pol, used


def test_lru_memory_per_slot_at_one_million_slots() -> None:
    n = 1_000_000

    def build(n: int) -> EvictionPolicy:
        pol = LRUPolicy(n)
        for part in np.array_split(np.arange(n), 50):
            pol.insert(part)
        pol.touch(np.arange(0, n, 3))
        return pol

    pol, traced = _traced(build, n)
    print(f"lru: {pol.nbytes / n:.1f} bytes/slot by nbytes, {traced / n:.1f} traced, at {n} slots")
    assert len(pol) == n
    assert pol.nbytes / n <= 24
    assert traced <= pol.nbytes + 64 * 1024  # nothing per slot beyond its arrays


def test_arc_memory_per_slot_and_per_ghost_at_one_million_slots() -> None:
    n = 1_000_000

    def build(n: int) -> EvictionPolicy:
        pol = ARCPolicy(n)
        pol.insert(np.arange(n))
        pol.touch(np.arange(0, n, 2))  # half of them to T2
        pol.evict(n, np.zeros(n, dtype=np.uint8))  # every tag becomes a ghost: the bound
        pol.insert(np.arange(0, n, 1000))  # ghost hits on some of them
        return pol

    pol, traced = _traced(build, n)
    assert isinstance(pol, ARCPolicy)
    ghosts = sum(pol.ghost_sizes())
    assert len(pol) == n // 1000 and ghosts == n - n // 1000
    per_ghost = pol.ghost_nbytes / n  # sized for the bound, num_slots ghosts
    print(f"arc: {pol.nbytes / n:.1f} bytes/slot by nbytes ({per_ghost:.1f} per ghost at the bound),"
          f" {traced / n:.1f} traced, at {n} slots")
    assert per_ghost <= 50
    assert (pol.nbytes - pol.ghost_nbytes) / n <= 25  # a stamp and two logs of 1.25 * n ids
    assert traced <= pol.nbytes + 64 * 1024
