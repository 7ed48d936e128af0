"""Eviction policies: batch order, the atomic evict contract, insert/remove and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from policy_helpers import A, SlotTags, build, evict, filled, pins, snapshot

from tiered_kv.errors import ConfigError
from tiered_kv.replay.policies import (
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    WindowPolicy,
    make_policy,
)

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
