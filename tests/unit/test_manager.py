"""The tier manager without an event loop: plans, completions, evictions, spills, promotions, events."""

from __future__ import annotations

import gc
import hashlib
import weakref

import numpy as np
import pytest

from tiered_kv.manager import READY, RESERVED, LookupResult, TierManager
from tiered_kv.policy import POLICIES

KB = 32


def keys(prefix: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}{i}".encode()).digest() for i in range(n)]


def ids(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def store(m: TierManager, ks: list[bytes]):
    plan = m.stores.prepare(ks, ids(len(ks)))
    if plan.spill is not None:
        m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
    wt = m.stores.complete(plan, True)
    if wt is not None:
        m.room.complete_spill(wt, np.ones(len(wt), dtype=bool))
    return plan


def load(m: TierManager, ks: list[bytes], max_promote: int = 1 << 20, ok=None) -> int:
    plan = m.loads.prepare(ks, max_promote)
    n = len(plan)
    if plan.spill is not None:
        m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
    if plan.promote is not None:
        mask = np.ones(len(plan.promote), dtype=bool) if ok is None else ok(plan.promote)
        n = m.loads.complete_promote(plan, mask)
    m.loads.complete_load(plan, n)
    return n


def test_store_then_lookup_and_dedupe():
    m = TierManager(16, None, KB)
    ks = keys("a", 4)
    assert m.lookup(ks).total == 0
    plan = store(m, ks)
    assert list(plan.cpu_slots) == [0, 1, 2, 3]  # ascending fresh slots: one run
    res = m.lookup(ks + keys("b", 2))
    assert (res.total, res.cpu, res.disk, res.in_flight) == (4, 4, 0, False)
    again = m.stores.prepare(ks + ks[:1], ids(5))
    assert (len(again.cpu_slots), again.deduped, again.in_flight) == (0, 5, 0)
    m.stores.complete(again, True)
    m.check_invariants()
    assert [k for kind, tier, k in m.take_events() if kind == "stored"] == [ks]


def test_a_key_in_flight_is_counted_not_stored_twice():
    m = TierManager(16, None, KB)
    ks = keys("a", 3)
    first = m.stores.prepare(ks, ids(3))
    assert m.lookup(ks).in_flight
    second = m.stores.prepare(ks, ids(3, 10))
    assert (len(second.cpu_slots), second.in_flight) == (0, 3)
    assert m.loads.prepare(ks, 8).stop == "in_flight"
    m.stores.complete(first, False)  # aborted: the slots are free again
    assert m.lookup(ks).total == 0 and m.cpu.free_count == 16
    m.check_invariants()


def test_full_cpu_tier_without_disk_evicts_tails_first():
    m = TierManager(4, None, KB)
    a, b = keys("a", 4), keys("b", 2)
    store(m, a)
    plan = store(m, b)
    assert plan.spill is None and len(plan.cpu_slots) == 2
    assert m.lookup(a).total == 2  # a's tail (a[2], a[3]) went, its head stays
    evicted = [k for kind, tier, k in m.take_events() if kind == "evicted"]
    assert len(evicted) == 1 and set(evicted[0]) == {a[2], a[3]}
    m.check_invariants()


def test_dirty_victims_are_spilled_before_their_slots_are_reused():
    m = TierManager(4, 16, KB)
    a, b = keys("a", 4), keys("b", 3)
    store(m, a)
    plan = m.stores.prepare(b, ids(3))
    spill = plan.spill
    assert spill is not None and spill.reuse and sorted(spill.cpu_slots) == sorted(plan.cpu_slots)
    # until the spill lands the victims are nowhere: in flight, not hits
    assert m.lookup(a) == LookupResult(4, 1, 0, 3) and m.lookup(a[1:]).in_flight
    assert set(map(bytes, spill.keys)) == set(a[1:])
    m.room.complete_spill(spill, np.array([bytes(k) != a[1] for k in spill.keys]))  # a[1]'s write fails
    m.stores.complete(plan, True)
    res = m.lookup(a)
    assert (res.total, res.cpu) == (1, 1)  # a[1] was lost by the failed write
    assert m.lookup(a[2:]).disk == 2
    dropped = [k for kind, tier, k in m.take_events() if kind == "dropped"]
    assert len(dropped) == 1 and len(dropped[0]) == 1
    m.check_invariants()


def test_one_policy_spans_cpu_and_disk_and_a_blocks_history_survives_promotion():
    """CPU and disk run one window policy (native/domain.hpp). A spill keeps the block's rank and list;
    a disk hit promoted to the CPU is remembered as re-referenced, so it lands in main, not the window."""
    assert TierManager(4, None, KB, "window").cpu.policy.name == "window"
    m = TierManager(4, 16, KB, "window")
    assert (m.cpu.policy.name, m.disk.policy.name) == ("window", "window")
    a, b = keys("a", 4), keys("b", 4)
    store(m, a)
    store(m, b)  # a moves down: first-time blocks, still in the window there
    assert m.disk.policy.list_sizes() == (4, 0) and m.lookup(a).disk == 4
    assert m.domain.history_sizes() == (0, 0)
    plan = m.loads.prepare(a[:2], 8)
    assert m.loads.complete_promote(plan, np.ones(2, dtype=bool)) == 2
    # Committed into the CPU before any touch, already in main: the disk copies' demotion passed
    # their history on (the b blocks they displaced moved down, still in the window).
    assert m.cpu.policy.list_sizes() == (2, 2) and m.disk.policy.list_sizes() == (2, 0)
    m.loads.complete_load(plan, 2)
    m.check_invariants()


def test_a_spilled_block_keeps_its_rank_and_the_hierarchys_victim_leaves_from_the_cpu():
    """ARC: a block hit twice is frequent, and stays so on disk. LRU: blocks touched on disk are more recent
    than the CPU's, so when both tiers are full the CPU's own blocks leave (no spill) and the disk keeps its."""
    m = TierManager(2, 4, KB, "arc")
    a = keys("a", 2)
    store(m, a)
    m.stores.touch(a)  # T2
    store(m, keys("b", 2))  # a moves down, still frequent
    assert m.lookup(a).disk == 2 and m.disk.policy.list_sizes() == (0, 2)
    m.check_invariants()

    m = TierManager(2, 2, KB, "lru")
    a, b = keys("a", 2), keys("b", 2)
    store(m, a)
    store(m, b)  # a on disk
    m.stores.touch(a)  # the disk's blocks are now the most recent of the hierarchy
    plan = store(m, keys("c", 2))
    assert plan.spill is None  # b, the least recent anywhere, left from the CPU
    assert m.lookup(a).disk == 2 and m.lookup(b).total == 0
    m.check_invariants()


def test_the_engines_own_hits_become_history_for_when_it_stores_the_block():
    """touch(held=True) of keys no tier holds records a reference: stored later, the block goes to ARC's T2."""
    m = TierManager(4, 16, KB, "arc")
    a = keys("a", 2)
    m.stores.touch(a, held=True)  # first reference (the engine computed them)
    m.stores.touch(a, held=True)  # hit in the engine's cache
    assert m.domain.history_sizes() == (0, 2)
    store(m, a)
    assert m.cpu.policy.list_sizes() == (0, 2) and m.domain.history_sizes() == (0, 0)
    c = keys("c", 2)
    m.stores.touch(c, held=True)  # seen once: stored into T1
    store(m, c)
    assert m.cpu.policy.list_sizes() == (2, 2)
    m.check_invariants()


def test_load_promotes_disk_hits_and_pins_until_complete():
    m = TierManager(4, 16, KB)
    a = keys("a", 4)
    store(m, a)
    store(m, keys("b", 4))  # pushes all of a to disk
    assert m.lookup(a).disk == 4
    plan = m.loads.prepare(a, 8)
    assert plan.promote is not None and len(plan.promote) == 4 and plan.stop == ""
    assert np.all(m.cpu.state[plan.promote.cpu_slots] == RESERVED)
    assert m.loads.prepare(a, 8).stop == "in_flight"  # a second load waits for this promotion
    n = m.loads.complete_promote(plan, np.ones(4, dtype=bool))
    assert n == 4 and np.all(m.cpu.pins[plan.cpu_slots] == 1)
    m.loads.complete_load(plan, n)
    assert np.all(m.cpu.pins == 0) and np.all(m.cpu.state[plan.cpu_slots] == READY)
    assert m.lookup(a).cpu == 4  # promoted; the disk copies stay (inclusive) until evicted
    m.check_invariants()


def test_a_failed_promotion_ends_the_run_and_drops_the_bad_block():
    m = TierManager(8, 16, KB)
    a = keys("a", 4)
    store(m, a)
    store(m, keys("b", 8))
    assert m.lookup(a).disk == 4
    n = load(m, a, ok=lambda job: np.array([True, True, False, True]))
    assert n == 2
    assert m.lookup(a).total == 2  # a[2] is gone from disk for good
    assert len(m.disk_invalidate) == 1 and len(m.disk_invalidate[0]) == 1
    m.check_invariants()


def test_a_disk_prefix_longer_than_the_cpu_tier_loads_in_chunks():
    m = TierManager(4, 32, KB)
    a = keys("a", 12)
    for i in range(0, 12, 4):
        store(m, a[i : i + 4])
    store(m, keys("x", 4))
    assert m.lookup(a).total == 12
    loaded = 0
    while loaded < 12:
        plan = m.loads.prepare(a[loaded:], 2)
        assert len(plan) and plan.stop in ("room", "")
        n = m.loads.complete_promote(plan, np.ones(len(plan.promote), dtype=bool)) if plan.promote else len(plan)
        if plan.spill is not None:
            m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
        m.loads.complete_load(plan, n)
        loaded += n
    assert loaded == 12
    m.check_invariants()


def test_write_through_pins_the_cpu_copy_while_it_is_written():
    m = TierManager(8, 8, KB, write_through=True)
    a = keys("a", 3)
    plan = m.stores.prepare(a, ids(3))
    job = m.stores.complete(plan, True)
    assert job is not None and not job.reuse and np.all(m.cpu.pins[job.cpu_slots] == 1)
    assert m.cpu.evictable == 0
    m.room.complete_spill(job, np.ones(3, dtype=bool))
    assert m.cpu.evictable == 3 and m.lookup(a).cpu == 3 and m.disk.n_ready == 3
    m.check_invariants()


def test_nothing_evictable_leaves_keys_unplaced():
    m = TierManager(2, None, KB)
    a = keys("a", 2)
    store(m, a)
    plan = m.loads.prepare(a, 4)  # pins both
    s = m.stores.prepare(keys("b", 2), ids(2))
    assert len(s.cpu_slots) == 0 and s.unplaced == 2
    m.stores.complete(s, True)
    m.loads.complete_load(plan, 2)
    m.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_the_invariants(seed, policy):
    rng = np.random.default_rng(seed)
    m = TierManager(16, 32, KB, policy, write_through=bool(seed % 2))
    pool = keys("p", 80)
    open_loads = []
    for _ in range(400):
        op = rng.integers(4)
        ks = [pool[i] for i in rng.choice(80, size=rng.integers(1, 9), replace=False)]
        if op == 0:
            plan = m.stores.prepare(ks, ids(len(ks)))
            if plan.spill is not None:
                m.room.complete_spill(plan.spill, rng.random(len(plan.spill)) < 0.9)
            wt = m.stores.complete(plan, bool(rng.random() < 0.9))
            if wt is not None:
                m.room.complete_spill(wt, rng.random(len(wt)) < 0.9)
        elif op == 1:
            plan = m.loads.prepare(ks, int(rng.integers(1, 6)))
            if plan.spill is not None:
                m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
            n = len(plan)
            if plan.promote is not None:
                n = m.loads.complete_promote(plan, rng.random(len(plan.promote)) < 0.9)
            open_loads.append((plan, n))
        elif op == 2 and open_loads:
            plan, n = open_loads.pop(int(rng.integers(len(open_loads))))
            m.loads.complete_load(plan, n)
        else:
            m.lookup(ks)
            m.stores.touch(ks)
        m.check_invariants()
    for plan, n in open_loads:
        m.loads.complete_load(plan, n)
    m.check_invariants()
    assert np.all(m.cpu.pins == 0)


def test_a_promotion_never_reads_a_disk_slot_its_own_spill_overwrites():
    """The CPU victims of a promotion spill to disk; the disk must not evict the blocks being promoted."""
    m = TierManager(2, 4, KB)
    a, b = keys("a", 2), keys("b", 2)
    store(m, a)
    store(m, b)  # a -> disk (slots 0, 1 of 4)
    store(m, keys("c", 2))  # b -> disk: the disk is full of a and b
    assert m.lookup(a).disk == 2 and m.disk.free_count == 0
    plan = m.loads.prepare(a, 2)  # needs both CPU slots: c spills, and the disk must evict b, not a
    assert plan.spill is not None and plan.promote is not None
    assert not set(plan.spill.disk_slots) & set(plan.promote.disk_slots)
    m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
    assert m.loads.complete_promote(plan, np.ones(len(plan.promote), dtype=bool)) == 2
    m.loads.complete_load(plan, 2)
    m.check_invariants()


@pytest.mark.parametrize("disk", [None, 32])
def test_a_dropped_manager_frees_its_tiers(disk):
    # The tiers' state / pins / key views used to point back at their tier: a cycle through numpy
    # arrays that the GC cannot traverse, so no manager's tiers were ever freed.
    m = TierManager(8, disk, KB, "arc")
    store(m, keys("a", 20))
    assert load(m, keys("a", 20)) > 0
    refs = [weakref.ref(o) for o in (m, m.cpu, m.disk, m.domain) if o is not None]
    del m
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
