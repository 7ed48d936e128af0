"""Shared by the eviction-policy tests (test_policy_*.py): building, filling and reading policies."""

from __future__ import annotations

import numpy as np

from tiered_kv.replay.policies import ARCPolicy, EvictionPolicy, WindowPolicy, make_policy


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
