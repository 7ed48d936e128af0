"""The adaptive-window LRU: FIFO window, promotion on a second reference, ghost-steered target, ghost memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_core.policy.window import WindowGhosts

from tiered_kv.errors import ConfigError
from tiered_kv.replay.policies import WindowPolicy, make_policy


def A(*slots: int) -> np.ndarray:
    return np.array(slots, dtype=np.int64)


def evict(pol: WindowPolicy, n: int, pinned: object = ()) -> list[int]:
    pins = np.zeros(pol.num_slots, dtype=np.uint16)
    pins[list(pinned)] = 1
    return pol.evict(n, pins).tolist()


class Tags:
    """key_tag: the key each slot holds, written before the slot is inserted."""

    def __init__(self, n: int) -> None:
        self.tags = np.zeros(n, dtype=np.uint64)

    def __call__(self, slots: np.ndarray) -> np.ndarray:
        return self.tags[slots]

    def insert(self, pol: WindowPolicy, slots: list[int] | np.ndarray, keys: list[int] | np.ndarray) -> None:
        self.tags[slots] = keys
        pol.insert(np.array(slots, dtype=np.int64))


def test_target_starts_at_a_tenth_and_make_policy_hands_key_tag_over() -> None:
    tags = Tags(20)
    pol = make_policy("window", 20, key_tag=tags)
    assert isinstance(pol, WindowPolicy) and pol.target == 2.0
    tags.insert(pol, [0, 1], [70, 71])
    assert evict(pol, 1) == [0]  # the window (2) is at its target, but main is empty
    assert pol.ghost_tags() == ([70], [])  # ghosts hold the key tags, not slot ids
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ConfigError, match="window policy: start"):
            WindowPolicy(8, start=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="low <= start <= high"):
        WindowPolicy(8, start=0.5)  # above the default high (0.2)


def test_the_window_is_fifo_and_a_touch_promotes_to_main() -> None:
    pol = WindowPolicy(8, start=0.5, high=0.5)  # target 4
    pol.insert(A(0, 1, 2, 3, 4, 5))
    assert pol.list_sizes() == (6, 0)
    pol.touch(A(2))  # its second reference: to main, the others keep their order
    assert pol.list_sizes() == (5, 1)
    # Window 5 > target 4: its FIFO head goes first; then main's LRU end; then the window again.
    assert pol.order() == [0, 2, 1, 3, 4, 5]
    pol.touch(A(2))  # a touch in main is a plain LRU touch: no change in the areas
    assert pol.list_sizes() == (5, 1)
    assert evict(pol, 2) == [0, 2]
    assert pol.list_sizes() == (4, 0) and pol.ghost_sizes() == (1, 1)


def test_touches_do_not_reorder_the_window_but_lift_slots_out_of_it() -> None:
    pol = WindowPolicy(6, start=1.0, high=1.0)  # the window may hold everything: eviction order is its FIFO
    pol.insert(A(3, 1, 4, 0))
    assert pol.order() == [3, 1, 4, 0]
    pol.touch(A(4, 3))  # both move to main (most recent: 3), the window keeps 1, 0 in order
    assert pol.list_sizes() == (2, 2)
    assert evict(pol, 4) == [4, 3, 1, 0]  # the window (2) is under its target (6): main's LRU end first


def test_ghost_hits_move_the_target_one_slot_each_within_its_bounds() -> None:
    tags = Tags(20)
    pol = WindowPolicy(20, key_tag=tags)  # target 2, bounds [1, 4]
    tags.insert(pol, list(range(20)), [100 + s for s in range(20)])
    pol.touch(A(18, 19))  # main: 18, 19
    assert evict(pol, 3) == [0, 1, 2]  # window 18 > 2: its FIFO head
    tags.insert(pol, [0], [100])  # a window ghost: straight into main, the window was too small
    assert pol.target == 3.0 and pol.list_sizes() == (15, 3)
    tags.insert(pol, [1, 2], [101, 102])  # two more: 5, clipped at 20 % of the tier
    assert pol.target == 4.0
    pol.demote(A(19))  # moved up to a faster tier: its key becomes main's newest ghost
    assert pol.ghost_tags() == ([], [119]) and 19 not in pol
    tags.insert(pol, [19], [119])  # a main ghost: main was too small
    assert pol.target == 3.0 and pol.list_sizes() == (15, 5)
    pol.remove(A(3))
    tags.insert(pol, [3], [999])  # no ghost: into the window, target unchanged
    assert pol.target == 3.0 and pol.list_sizes() == (15, 5)


def test_one_step_per_ghost_hit_once_per_batch_and_a_repeated_tag_counts_once() -> None:
    tags = Tags(16)
    pol = WindowPolicy(16, key_tag=tags, start=0.0, low=0.0, high=1.0)
    tags.insert(pol, list(range(16)), list(range(16)))
    pol.touch(np.arange(6))  # main 0..5, window 6..15
    assert evict(pol, 10) == list(range(6, 16))  # target 0: the whole window goes first
    assert evict(pol, 2) == [0, 1]  # main -> its ghosts
    assert pol.ghost_sizes() == (10, 2)
    # Two window-ghost hits, one main-ghost hit and a repeat of a ghost's tag (counted once) in one batch:
    tags.insert(pol, [6, 7, 8, 9], [10, 11, 0, 10])
    assert pol.target == 1.0  # 0 + 2 - 1
    assert pol.list_sizes() == (1, 7)  # the repeated tag's second slot is new: the window
    tags.insert(pol, [10], [12])
    assert pol.target == 2.0


def test_each_ghost_list_keeps_its_own_bound() -> None:
    tags = Tags(8)
    pol = WindowPolicy(8, key_tag=tags)  # window ghosts up to 32, main's up to 16
    for round_ in range(8):
        keys = [1000 * round_ + s for s in range(8)]
        tags.insert(pol, list(range(8)), keys)
        if round_ % 2:
            pol.touch(np.arange(8))
        evict(pol, 8)
        b1, b2 = pol.ghost_sizes()
        assert b1 <= 32 and b2 <= 16
    assert pol.ghost_sizes() == (32, 16)


def test_demote_remembers_a_hit_as_main_s_ghost_and_remove_forgets_it() -> None:
    tags = Tags(8)
    pol = WindowPolicy(8, key_tag=tags)
    tags.insert(pol, [0, 1, 2], [50, 51, 52])
    pol.demote(A(0, 2, 0))  # a repeated slot counts once; untracked slots are ignored
    pol.remove(A(1))
    assert pol.ghost_tags() == ([], [50, 52]) and len(pol) == 0
    tags.insert(pol, [3, 4], [52, 51])  # the demoted block comes back: main; the removed one: the window
    assert pol.list_sizes() == (1, 1)


def test_never_evicts_pinned_and_evict_is_atomic() -> None:
    tags = Tags(12)
    pol = WindowPolicy(12, key_tag=tags)
    tags.insert(pol, list(range(10)), [50 + s for s in range(10)])
    pol.touch(A(1, 3, 5))
    pinned = {0, 2, 3, 7, 8}
    before = (pol.order(), pol.target, pol.ghost_tags(), pol.list_sizes())
    assert evict(pol, 6, pinned) == []  # only 5 unpinned: nothing happens
    assert (pol.order(), pol.target, pol.ghost_tags(), pol.list_sizes()) == before
    victims = evict(pol, 5, pinned)
    assert sorted(victims) == [1, 4, 5, 6, 9] and not pinned & set(victims)
    assert all(s not in pol for s in victims) and len(pol) == 5


def test_memory_per_ghost_at_the_bound() -> None:
    n = 100_000
    tags = Tags(n)
    pol = WindowPolicy(n, key_tag=tags)
    for round_ in range(6):  # four rounds fill the window's ghosts (4n), two main's (2n)
        tags.insert(pol, np.arange(n), np.arange(round_ * n, (round_ + 1) * n))
        if round_ >= 4:
            pol.touch(np.arange(n))
        pol.evict(n, np.zeros(n, dtype=np.uint8))
    ghosts = sum(pol.ghost_sizes())
    assert pol.ghost_sizes() == (4 * n, 2 * n)
    per_ghost = pol.ghost_nbytes / ghosts
    print(f"window: {per_ghost:.1f} bytes per ghost, {pol.nbytes / n:.1f} bytes per slot, at {n} slots")
    assert per_ghost <= 50


@settings(max_examples=50, deadline=None)
@given(
    cap=st.integers(1, 9),
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1)), max_size=12), min_size=1, max_size=12
    ),
)
def test_ghost_batches_trim_like_one_at_a_time(cap: int, batches: list[list[tuple[int, int]]]) -> None:
    """A batch of new ghosts ends in the same lists as adding its tags one by one, under each list's bound."""
    bounds = (cap // 2, cap - cap // 2)
    batched, single = WindowGhosts(*bounds), WindowGhosts(*bounds)
    ref: list[list[int]] = [[], []]
    for batch in batches:
        tags = np.array([t for t, _ in batch], dtype=np.uint64)
        lids = np.array([lid for _, lid in batch], dtype=np.int64)
        batched.add(tags, lids)
        for t, lid in batch:
            single.add(np.array([t], dtype=np.uint64), np.array([lid], dtype=np.int64))
            for lst in ref:
                if t in lst:
                    lst.remove(t)
            ref[lid].append(t)
            del ref[lid][: max(0, len(ref[lid]) - bounds[lid])]
        assert [batched.tags(0), batched.tags(1)] == [single.tags(0), single.tags(1)] == ref
