"""Issue 37: protected evictions that leaked slots, refused calls that changed state, the domain's pointers.

One test (or a few) per item of the issue, numbered as there. A refused call is checked to change
nothing (a snapshot of every observable before and after). The lifetime tests run in a subprocess
(same environment, so under `make test-core-debug` the sanitizer build goes along): on a core
without the fix they read freed memory.
"""

from __future__ import annotations

import gc
import hashlib
import textwrap

import numpy as np
import pytest
from test_core_hardening import run_isolated

from tiered_kv.core import core, seeds
from tiered_kv.errors import TieredKVError, TransferError
from tiered_kv.manager import TierManager
from tiered_kv.manager.tier_index import FREE, READY, TierIndex, join_hierarchy
from tiered_kv.policy import HIGH, LOW, START

KB = 32


def key(i: int | str) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:KB]


def keys(prefix: str, n: int) -> list[bytes]:
    return [key(f"{prefix}{i}") for i in range(n)]


def snapshot(t: TierIndex) -> tuple:
    """Every observable of a tier (counts, states, pins, keys, lists)."""
    held = np.flatnonzero(t.state != FREE)
    return (t.free_count, t.n_ready, t.n_reserved, t.n_ready_pinned, t.evictable, t.state.tolist(),
            t.pins.tolist(), t.keys_of(held), t.policy_order(), t.cold_order(), t.list_sizes(),
            t.ghost_sizes())  # fmt: skip


def filled(n: int, ready: int, policy: str = "lru") -> TierIndex:
    t = TierIndex("cpu", n, KB, policy)
    t.commit(t.reserve(keys("r", ready)))
    return t


def bare_domain(cpu: int = 4, disk: int = 4, kind: int = 0):
    s = seeds()
    return core.Domain(kind, cpu, disk, s, START, LOW, HIGH), s


# -- 1. a protected store under a full tier with pins: the second evict must not count the first's victims
@pytest.mark.parametrize("disk", [None, 6])
def test_a_protected_store_under_pins_places_what_fits_and_leaks_nothing(disk) -> None:
    m = TierManager(10, disk, KB, "lru", protect_share=0.9)
    old = keys("old", 10)
    plan = m.stores.prepare(old, np.arange(10))
    m.stores.complete(plan, True)
    load = m.loads.prepare(old[:6], 0)  # pins 6 blocks until complete_load
    m.hint("b", old[6:9], protect=True)  # 3 more held while the first evict picks
    new = keys("a", 6)
    m.hint("a", new, protect=True)
    store = m.stores.prepare(new, np.arange(6))  # refused before: "4 evictable slots counted but fewer found"
    assert len(store.cpu_slots) == 4  # 1 unprotected, then 3 of b's (the 6 loaded stay pinned)
    m.cpu.check_invariants()
    m.stores.complete(store, True)
    m.loads.complete_load(load, len(load))
    m.cpu.check_invariants()
    assert m.cpu.n_ready + m.cpu.free_count == 10  # no slot READY in no list, none RESERVED for no plan
    m.release("a")
    m.release("b")
    again = m.stores.prepare(keys("c", 10), np.arange(10))  # a full tier's worth fits again
    assert len(again.cpu_slots) == 10


# -- 2. plan_store and evict change nothing when they refuse ---------------------------------------
def test_plan_store_refused_by_outstanding_victims_reserves_nothing() -> None:
    t = filled(4, 3)  # one free slot
    t.evict(2)  # two victims outstanding: still READY and counted evictable, in no list
    before = snapshot(t)
    with pytest.raises(TieredKVError, match=r"evict\(2\): 3 evictable slots counted"):
        t.plan_store(keys("n", 3), [])  # reserves 1, then must evict 2 of the 1 in the policy
    assert snapshot(t) == before  # the reserved slot went back: nothing RESERVED for no plan
    assert t.find(keys("n", 3)).tolist() == [-1, -1, -1]


def test_evict_refused_leaves_the_cold_list_as_it_was() -> None:
    t = filled(5, 5)
    t.demote(np.array([0]))  # slot 0 cold
    t.evict(2)  # cold 0 and the policy's oldest out, outstanding
    t.demote(np.array([4]))  # a new cold slot
    before = snapshot(t)
    assert t.evictable == 5 and t.cold_order() == [4]
    with pytest.raises(TieredKVError, match=r"evict\(4\)"):
        t.evict(4)  # 1 cold + 2 in the policy: fewer than counted
    assert snapshot(t) == before


def test_evict_refused_in_a_hierarchy_changes_nothing() -> None:
    cpu, disk, _ = join_hierarchy("arc", 4, 4, KB)
    cpu.commit(cpu.reserve(keys("h", 4)))
    cpu.demote(np.array([3]))
    cpu.evict(2)  # cold 3 and the policy's first out, outstanding
    cpu.demote(np.array([1]))  # a new cold slot: a refused evict must leave it there
    before = snapshot(cpu)
    with pytest.raises(TieredKVError, match="evictable slots counted"):
        cpu.evict(4)
    assert snapshot(cpu) == before


# -- 3. the domain outlives its tiers, and a tier freed first makes the other refuse ----------------
# A bare native CPU + disk pair in one domain, for the snippets that free one of them in a fresh process
# (bare core objects: nothing else holds a reference that would keep them alive).
BARE_PAIR = """
import gc, hashlib
from tiered_kv.core import core, seeds
from tiered_kv.policy import HIGH, LOW, START
s = seeds()
tier = lambda name: core.Tier(name, 4, 32, 1, s, START, LOW, HIGH)
d = core.Domain(1, 4, 4, s, START, LOW, HIGH)
cpu, disk = tier("cpu"), tier("disk")
d.attach(cpu, disk)
"""


def test_freeing_the_domain_object_keeps_it_alive_for_its_tiers() -> None:
    out = run_isolated(
        BARE_PAIR
        + textwrap.dedent(
            """
        del d
        gc.collect()
        junk = [bytearray(4096) for _ in range(2000)]  # reuse what a freed domain left
        cpu.commit(cpu.reserve([hashlib.sha256(b"%d" % i).digest() for i in range(4)]))
        victims, _, _, spill_cpu, spill_disk, _, _ = cpu.make_room(2, True)
        cpu.reassign(spill_cpu, [hashlib.sha256(b"new%d" % i).digest() for i in range(2)])
        disk.commit(spill_disk)
        cpu.commit(spill_cpu)
        cpu.check_invariants(); disk.check_invariants()
        print("ok", len(victims), cpu.n_ready, disk.n_ready)
        """
        )
    )
    assert "ok 2 4 2" in out


def test_a_tier_freed_first_makes_the_other_refuse() -> None:
    out = run_isolated(
        BARE_PAIR
        + textwrap.dedent(
            """
        from tiered_kv.errors import TieredKVError
        del disk
        gc.collect()
        slots = cpu.reserve([hashlib.sha256(b"%d" % i).digest() for i in range(4)])
        for call in (lambda: cpu.commit(slots), lambda: cpu.make_room(1, True), cpu.check_invariants):
            try:
                call()
                print("accepted")
            except TieredKVError as e:
                print("refused:", e)
        print("reserved", cpu.n_reserved)
        """
        )
    )
    assert out.count("refused: cpu:") == 3 and "other tier was freed" in out and "accepted" not in out
    assert "reserved 4" in out


# -- 4. attach is all or nothing ---------------------------------------------------------------------
def test_a_refused_attach_leaves_both_tiers_and_the_domain_unattached() -> None:
    d, s = bare_domain(4, 4)
    cpu = TierIndex("cpu", 4, KB, key_seeds=s)
    wrong, full = TierIndex("disk", 5, KB, key_seeds=s), TierIndex("disk", 4, KB, key_seeds=s)
    full.commit(full.reserve([key("x")]))
    with pytest.raises(TieredKVError, match="has 4 slots at level 1, the tier 5"):
        d.attach(cpu, wrong)
    with pytest.raises(TieredKVError, match="joins a hierarchy while empty .*1 READY"):
        d.attach(cpu, full)
    assert not cpu.in_domain and not wrong.in_domain and not full.in_domain
    disk = TierIndex("disk", 4, KB, key_seeds=s)
    d.attach(cpu, disk)  # a correct retry is accepted
    assert cpu.in_domain and disk.in_domain
    cpu.commit(cpu.reserve(keys("k", 4)))
    victims, _, _, spill_cpu, spill_disk, _, _ = cpu.make_room(2, True)
    assert len(victims) == 2 and len(spill_disk) == 2
    cpu.reassign(spill_cpu, keys("n", 2))
    disk.commit(spill_disk)
    cpu.commit(spill_cpu)
    cpu.check_invariants()
    disk.check_invariants()


# -- 5. locate and leading_run need one key length over both tiers -----------------------------------
def test_locate_and_leading_run_refuse_tiers_of_two_key_lengths() -> None:
    cpu, disk = TierIndex("cpu", 4, KB), TierIndex("disk", 4, 8)
    disk.commit(disk.reserve([b"\x01" * 8]))
    for call in (lambda: core.locate(cpu, disk, [key(1)]), lambda: core.leading_run(cpu, disk, [key(1)])):
        with pytest.raises(TieredKVError, match="different key lengths: cpu 32 bytes, disk 8"):
            call()
    assert core.leading_run(cpu, None, [key(1)])[0] == 0  # one tier: nothing to compare


# -- 6. copy_rows never copies between overlapping sides ----------------------------------------------
def test_rows_refuse_sides_that_overlap() -> None:
    buf = np.zeros((8, 16), dtype=np.uint8)
    with pytest.raises(TransferError, match="region 0 of side 0 overlaps region 0 of side 1"):
        core.Rows([buf[0:5]], [buf[3:8]])
    with pytest.raises(TransferError, match="overlaps"):
        core.Rows([buf], [buf])
    other = np.arange(64, dtype=np.uint8).reshape(4, 16)
    rows = core.Rows([buf[0:4]], [buf[4:8]])  # adjacent, not overlapping: fine
    rows.copy(0, np.array([0, 1]), np.array([2, 3]))
    core.Rows([other], [buf[4:8]]).copy(0, np.array([3]), np.array([0]))
    assert buf[4].tolist() == other[3].tolist()


# -- 7. make_room when a CPU block's key is READY on disk outside the disk's cold list ----------------
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("disk_full", [False, True])
def test_make_room_with_a_key_on_both_tiers_keeps_both_consistent(policy, disk_full) -> None:
    cpu, disk, _ = join_hierarchy(policy, 2, 2, KB)
    k = key("both")
    d = disk.reserve([k] + ([key("other")] if disk_full else []))
    disk.commit(d)  # fresh on disk: in the policy, not cold
    cpu.commit(cpu.reserve([k, key("cpu")]))  # the same key READY on the CPU too (a direct caller can)
    out = cpu.make_room(1, True)
    victims, clean, spill_cpu = out[0], out[2], out[3]
    assert victims.tolist() == [0] and clean == 1 and not len(spill_cpu)  # leaves as a clean drop, no spill
    disk.check_invariants()
    assert disk.find_ready([k]).tolist() == [int(d[0])] and int(d[0]) in disk.policy_order()  # keeps its own rank
    cpu.reassign(victims, [key("new")])
    cpu.commit(victims)
    cpu.check_invariants()
    disk.check_invariants()


# -- 8. policy_insert refuses cold, listed and non-READY slots ----------------------------------------
@pytest.mark.parametrize("hierarchy", [True, False])
def test_policy_insert_refuses_slots_already_in_a_list_or_not_ready(hierarchy) -> None:
    cpu = join_hierarchy("lru", 4, 4, KB)[0] if hierarchy else TierIndex("cpu", 4, KB)
    cpu.commit(cpu.reserve(keys("p", 2)))
    cpu.demote(np.array([0]))  # cold
    r = cpu.reserve([key("res")])  # RESERVED
    before = snapshot(cpu)
    for slots, msg in (([0], "in list 3 .the cold list."), ([1], "in list 1"), (r.tolist(), "in state 1, expected 2"),
                       ([3], "in state 0, expected 2")):  # fmt: skip
        with pytest.raises(TieredKVError, match=msg):
            cpu.policy_insert(np.array(slots))
        assert snapshot(cpu) == before
    assert cpu.cold_order() == [0]  # finite: slot 0 is in one list
    cpu.check_invariants()


# -- 9. pin refuses FREE slots; attach refuses one tier twice and a tier of another domain ------------
def test_pin_refuses_a_free_slot() -> None:
    t = filled(4, 1)
    r = t.reserve([key("res")])
    before = snapshot(t)
    with pytest.raises(TieredKVError, match="pin of slot 3, which is FREE"):
        t.pin(np.array([0, 3]))
    assert snapshot(t) == before
    t.pin(np.array([0, int(r[0])]))  # READY and RESERVED slots can be pinned
    t.unpin(np.array([0, int(r[0])]))
    t.abort(r)
    t.check_invariants()


def test_attach_refuses_one_tier_at_both_levels_and_a_tier_of_another_domain() -> None:
    d, s = bare_domain(4, 4)
    t = TierIndex("cpu", 4, KB, key_seeds=s)
    with pytest.raises(TieredKVError, match="one tier cannot be both levels"):
        d.attach(t, t)
    assert not t.in_domain
    cpu, disk, _ = join_hierarchy("lru", 4, 4, KB)
    other = TierIndex("disk", 4, KB)
    with pytest.raises(TieredKVError, match="already part of a hierarchy"):
        d.attach(cpu, other)
    with pytest.raises(TieredKVError, match="already part of a hierarchy"):
        d.attach(t, disk)
    assert not t.in_domain and not other.in_domain
    d.attach(t, other)  # still free to take a pair
    t.commit(t.reserve([key(1)]))
    t.check_invariants()
    gc.collect()
    assert t.state.tolist()[0] == READY
