"""Issue 12's mechanisms in the tier manager: orphan-free continuations, exclusive moves between tiers,
session release, and in-flight blocks counted by lookup."""

from __future__ import annotations

import numpy as np
from test_manager import ids, keys, load

from tiered_kv.manager import LookupResult, TierManager


def store(m: TierManager, ks: list[bytes], prefix: list[bytes] = ()):
    plan = m.stores.prepare(ks, ids(len(ks)), prefix)
    if plan.spill is not None:
        m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
    m.stores.complete(plan, True)
    return plan


def cpu_keys(m: TierManager) -> set[bytes]:
    return set(m.cpu.resident())


def disk_keys(m: TierManager) -> set[bytes]:
    return set(m.disk.resident()) if m.disk is not None else set()


def test_a_chunked_store_never_evicts_its_own_head():
    """Issue 12's reproduction: 4 slots, a 7-block prefix stored in two chunks kept [2, 4, 5, 6] and hit 0."""
    m = TierManager(4, None, 32)
    chain = keys("c", 7)
    store(m, chain[:3])
    plan = store(m, chain[3:], prefix=chain[:3])
    assert plan.unplaced == 3  # the blocks that would need the head's slots stay out
    assert m.lookup(chain).total == 4  # the head survives: a usable prefix, no orphans
    m.check_invariants()


def test_a_continuation_leaves_the_whole_chain_head_most_recent():
    m = TierManager(6, None, 32)
    chain = keys("c", 4)
    store(m, chain[:2])
    store(m, keys("other", 2))
    store(m, chain[2:], prefix=chain[:2])
    # One more block evicts the oldest: the other request's, never the chain's head.
    store(m, keys("x", 1))
    assert m.lookup(chain).total == 4
    m.check_invariants()


def test_demoted_disk_copy_is_the_first_disk_victim_while_the_cpu_holds_the_block():
    m = TierManager(4, 6, 32)
    a, b, c, d, e = (keys(x, 2) for x in "abcde")
    for chunk in (a, b, c, d, e):
        store(m, chunk)  # disk (oldest first): a, b, c; CPU: d, e
    assert load(m, c) == 2  # promoted: d spills, a (oldest) makes room; c's disk copy is a duplicate
    assert disk_keys(m) == set(b) | set(c) | set(d)
    store(m, keys("f", 2))  # e spills: the duplicate goes, not b (the oldest, but the only copy)
    assert disk_keys(m) == set(b) | set(d) | set(e)
    assert set(c) <= cpu_keys(m)
    m.check_invariants()


def test_a_clean_cpu_victim_makes_its_disk_copy_most_recent_again():
    m = TierManager(2, 6, 32)
    a, b, c, d, e = (keys(x, 2) for x in "abcde")
    for chunk in (a, b, c):
        store(m, chunk)  # disk: a, b; CPU: c
    assert load(m, a) == 2  # c spills; disk: a (duplicate), b, c
    store(m, d)  # a leaves the CPU clean: dropped there, its disk copy is the newest on disk
    store(m, e)  # d spills and needs room: b goes (the oldest), not a
    assert disk_keys(m) == set(c) | set(a) | set(d)
    assert m.lookup(a).total == 2
    m.check_invariants()


def test_an_exclusive_load_makes_the_cpu_copy_the_next_victim_and_it_is_dropped_not_spilled():
    m = TierManager(4, 8, 32)
    a, b = keys("a", 2), keys("b", 2)
    store(m, a)
    store(m, b)
    plan = m.loads.prepare(b, 1 << 20, exclusive=True)
    m.loads.complete_load(plan, len(plan))
    plan = m.stores.prepare(keys("n", 2), ids(2))
    assert plan.spill is None  # the engine holds b: its CPU copies are dropped, not written to disk
    m.stores.complete(plan, True)
    assert not (set(b) & (cpu_keys(m) | disk_keys(m)))
    assert set(a) <= cpu_keys(m)
    # Stored back later (the engine evicted them): a plain store, most recent again.
    store(m, b)
    assert set(b) <= cpu_keys(m)
    m.check_invariants()


def test_an_inclusive_load_keeps_the_cpu_copy_most_recent():
    m = TierManager(4, None, 32)
    a, b = keys("a", 2), keys("b", 2)
    store(m, a)
    store(m, b)
    assert load(m, a) == 2
    store(m, keys("n", 2))
    assert set(a) <= cpu_keys(m) and not set(b) & cpu_keys(m)


def test_released_session_tail_goes_first_but_a_shared_head_stays():
    m = TierManager(8, None, 32)
    system = keys("sys", 2)
    s1 = system + keys("s1", 3)
    s2 = system + keys("s2", 3)
    store(m, s1)
    store(m, s2)
    m.hint("one", s1)
    m.hint("two", s2)
    assert m.release("one") == s1[2:]  # the system prompt is shared with a live session
    store(m, keys("new", 3))  # needs 3 slots: s1's tail goes, though s1 is more recent than nothing else
    assert not set(s1[2:]) & cpu_keys(m)
    assert m.lookup(s2).total == 5
    assert m.release("unknown") == []
    m.check_invariants()


def test_without_release_lru_evicts_the_older_session():
    m = TierManager(8, None, 32)
    s1, s2 = keys("s1", 4), keys("s2", 4)
    store(m, s1)
    store(m, s2)
    m.hint("two", s2)
    assert m.release("two") == s2
    store(m, keys("new", 4))
    assert m.lookup(s1).total == 4 and m.lookup(s2).total == 0


def test_lookup_counts_blocks_in_flight_as_pending_hits():
    m = TierManager(8, None, 32)
    ks = keys("k", 4)
    store(m, ks[:2])
    plan = m.stores.prepare(ks[2:], ids(2))  # reserved, copy not landed
    assert m.lookup(ks) == LookupResult(4, 2, 0, 2)
    assert m.lookup(ks).in_flight
    m.stores.complete(plan, False)  # the copy failed: they were never hits
    assert m.lookup(ks) == LookupResult(2, 2, 0, 0)


def test_a_live_session_expecting_a_follow_up_outranks_every_one_off_block():
    m = TierManager(6, None, 32, protect_share=1.0)
    s1, other = keys("s1", 2), keys("other", 2)
    store(m, s1)
    m.hint("one", s1, protect=True)
    store(m, other)
    store(m, keys("x", 2))
    store(m, keys("new", 2))  # LRU would take s1 (the oldest): it is protected, "other" goes
    assert m.lookup(s1).total == 2 and m.lookup(other).total == 0
    m.release("one")  # released: no protection, and first to go
    store(m, keys("more", 2))
    assert m.lookup(s1).total == 0
    m.check_invariants()


def test_protection_is_capped_and_the_oldest_session_loses_it_first():
    m = TierManager(6, None, 32, protect_share=0.5)  # at most 3 protected keys
    s1, s2 = keys("s1", 2), keys("s2", 2)
    store(m, s1)
    m.hint("one", s1, protect=True)
    store(m, s2)
    m.hint("two", s2, protect=True)  # 4 > 3: "one" loses its protection (still live)
    assert m.sessions.n_protected == 2 and "one" in m.sessions
    store(m, keys("x", 2))
    store(m, keys("new", 2))  # s1 is the oldest and unprotected now
    assert m.lookup(s1).total == 0 and m.lookup(s2).total == 2
    store(m, keys("newer", 2))  # s2 is the oldest now, but protected: x goes
    assert m.lookup(s2).total == 2 and m.lookup(keys("x", 2)).total == 0


def test_protected_blocks_outlast_any_amount_of_one_off_traffic_and_go_only_for_protected_blocks():
    """Not a second chance: ten tiers' worth of one-off blocks pass through and the session's chain stays.
    A one-off store larger than the unprotected room stores what fits rather than displace them; the
    share bound takes protection from the oldest session when a new one would exceed it."""
    for policy in ("lru", "arc", "window"):
        m = TierManager(8, None, 32, policy, protect_share=1.0)
        chat = keys("chat", 4)
        store(m, chat)
        m.hint("c", chat, protect=True)
        for i in range(40):
            store(m, keys(f"one-off{i}", 2))
        assert m.lookup(chat).total == 4, policy
        big = store(m, keys("big", 8))  # more than the unprotected room: 4 are stored, the chain stays
        assert len(big.cpu_slots) == 4 and m.lookup(chat).total == 4, policy
        more = keys("more", 6)
        m.hint("d", more, protect=True)  # 4 + 6 > 8 protected keys: the older session "c" loses it
        store(m, more)  # big's 4, then chat (ordinary and oldest now) make the room
        assert m.lookup(more).total == 6 and m.lookup(chat).total == 0, policy
        m.check_invariants()


def test_hints_rank_across_cpu_and_disk_under_one_policy():
    """With a disk tier the protected blocks are held in both tiers: one-off blocks move down and leave first."""
    m = TierManager(4, 4, 32, "arc", protect_share=1.0)
    chat = keys("chat", 3)
    store(m, chat)
    m.hint("c", chat, protect=True)
    for i in range(12):
        store(m, keys(f"one-off{i}", 2))
    assert m.lookup(chat).total == 3
    m.check_invariants()


def test_a_session_idle_past_the_bound_loses_its_protection():
    now = [0.0]
    m = TierManager(6, None, 32, protect_share=1.0, session_idle_s=60.0)
    m.sessions._clock = lambda: now[0]
    chat = keys("chat", 2)
    store(m, chat)
    m.hint("c", chat, protect=True)
    now[0] = 59.0
    store(m, keys("a", 4))
    store(m, keys("b", 2))  # still protected: a goes
    assert m.lookup(chat).total == 2
    now[0] = 61.0  # idle past the bound: an ordinary (old) chain now
    store(m, keys("c", 4))
    assert m.lookup(chat).total == 0 and m.sessions.n_protected == 0 and "c" in m.sessions


def test_marking_everything_expect_followup_is_held_to_the_share():
    """A client that marks every request: at most protect_share of the slots are protected, so one-off
    traffic keeps the rest, and the oldest marked chains lose protection first."""
    m = TierManager(10, None, 32, protect_share=0.5)  # at most 5 keys
    for i in range(6):
        ks = keys(f"greedy{i}", 2)
        store(m, ks)
        m.hint(f"g{i}", ks, protect=True)
    assert m.sessions.n_protected <= 5
    for i in range(10):
        store(m, keys(f"one-off{i}", 1))
    assert sum(m.lookup(keys(f"greedy{i}", 2)).total for i in range(6)) <= 5
    m.check_invariants()
