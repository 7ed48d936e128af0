"""Every policy against a plain-Python reference model: long random runs and hypothesis state machines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from policy_helpers import SlotTags, evict, snapshot

from tiered_kv.replay.policies import (
    POLICIES,
    ARCPolicy,
    WindowPolicy,
    make_policy,
)

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
    universe = (
        12 * n if name == "window" else 40
    )  # enough keys to reach the bounds, few enough for ghost hits
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
