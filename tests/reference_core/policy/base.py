"""The reference policies' shared helpers; the interface and argument checks are tiered_kv.replay.policies.base's."""

from __future__ import annotations

import numpy as np

from tiered_kv.errors import SlotError
from tiered_kv.replay.policies.base import (  # noqa: F401 - re-exported to the reference policies
    EMPTY,
    MAX_SLOTS,
    EvictionPolicy,
    as_slots,
    check_evict_n,
    check_num_slots,
    check_pins,
)

UNTRACKED = -1


def stamp_dtype(max_code: int) -> type[np.signedinteger]:
    """The narrowest of int32/int64 holding every stamp code up to ``max_code``."""
    return np.int32 if max_code < 2**31 else np.int64


def unpinned(pins: np.ndarray | None, slots: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``live`` and not pinned (``pins`` None: nothing is pinned, ``live`` itself comes back)."""
    if pins is None:
        return live
    return live & (pins[slots] == 0)


def check_untracked(stamp: np.ndarray, slots: np.ndarray, policy: str) -> None:
    """ValueError unless every slot is untracked (stamp -1; tracked stamps are >= 0)."""
    if slots.size and np.maximum.reduce(stamp[slots]) != UNTRACKED:
        bad = int(slots[stamp[slots] != UNTRACKED][0])
        raise SlotError(f"slot {bad} is already tracked by the {policy} policy")


def repeated_slot(slots: np.ndarray) -> ValueError:
    """The error for an insert batch that names a slot twice."""
    values, counts = np.unique(slots, return_counts=True)
    return ValueError(f"slot {int(values[counts > 1][0])} appears twice in one insert batch")


def check_new(stamp: np.ndarray, slots: np.ndarray, policy: str) -> None:
    """ValueError unless every slot is untracked and appears once; leaves ``stamp`` as it was."""
    check_untracked(stamp, slots, policy)
    if slots.size > 1:
        once = distinct_winners(stamp, slots)
        stamp[slots] = UNTRACKED
        if not np.logical_and.reduce(once):
            raise repeated_slot(slots)


def distinct_winners(stamp: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """A mask with True at exactly one position per distinct slot (cheaper than np.unique).

    Overwrites ``stamp[slots]``: the caller restores or replaces them.
    """
    marks = -2 - np.arange(slots.size, dtype=np.int64)
    stamp[slots] = marks
    return stamp[slots] == marks


def last_occurrences(slots: np.ndarray) -> np.ndarray:
    """``slots`` with repeats dropped, each slot kept at its last position, order otherwise kept."""
    rev = slots[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    return slots[np.sort(slots.size - 1 - first_in_rev)]
