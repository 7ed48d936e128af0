"""ARC's adaptation (ghosts, p, scans) and every policy's memory per slot at one million slots."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import numpy as np
from policy_helpers import A, SlotTags, evict
from reference_core.policy.tagtable import TagTable

from tiered_kv.replay.policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
)

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
    print(
        f"arc: {pol.nbytes / n:.1f} bytes/slot by nbytes ({per_ghost:.1f} per ghost at the bound),"
        f" {traced / n:.1f} traced, at {n} slots"
    )
    assert per_ghost <= 50
    assert (pol.nbytes - pol.ghost_nbytes) / n <= 25  # a stamp and two logs of 1.25 * n ids
    assert traced <= pol.nbytes + 64 * 1024
