"""Least-recently-used eviction over one vectorized recency log (see recency.py).

Prefix semantics: the manager inserts and touches a request's blocks
last-block-first (one batch in reverse prefix order), so the request's first
block ends most recent. LRU then evicts a prefix from its tail towards its
head, and what survives is always a usable leading prefix.

Cost: insert, touch and evict are a fixed number of numpy calls per batch
(about a dozen), no Python step per slot; the log compacts once per ~num_slots
appends. Memory: a 4-byte stamp per slot and a log of 1.5 * num_slots + 16
int64 slot ids, so ~16 bytes per slot.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .base import (
    EMPTY,
    UNTRACKED,
    EvictionPolicy,
    as_slots,
    check_evict_n,
    check_num_slots,
    check_pins,
    check_untracked,
    distinct_winners,
    repeated_slot,
    stamp_dtype,
)
from .recency import RecencyLog

_SLACK = 16


class LRUPolicy(EvictionPolicy):
    """Plain LRU: evicts the least recently inserted-or-touched unpinned slot first."""

    name: ClassVar[str] = "lru"

    __slots__ = ("_n", "_stamp", "_log")

    def __init__(self, num_slots: int) -> None:
        self._n = check_num_slots(num_slots)
        capacity = num_slots + num_slots // 2 + _SLACK
        self._stamp = np.full(num_slots, UNTRACKED, dtype=stamp_dtype(capacity))
        self._log = RecencyLog(self._stamp, 0, 1, capacity)

    def insert(self, slots: np.ndarray) -> None:
        s = as_slots(slots, self._n)
        check_untracked(self._stamp, s, self.name)
        if self._log.append(s):
            # A slot repeated: undo (the appended entries go stale) and refuse the batch.
            self._stamp[s] = UNTRACKED
            raise repeated_slot(s)
        self._log.size += s.size

    def touch(self, slots: np.ndarray) -> None:
        s = as_slots(slots, self._n)
        self._log.append(s[self._stamp[s] != UNTRACKED])

    def remove(self, slots: np.ndarray) -> None:
        s = as_slots(slots, self._n)
        s = s[self._stamp[s] != UNTRACKED]
        if s.size:
            self._log.size -= int(np.count_nonzero(distinct_winners(self._stamp, s)))
            self._stamp[s] = UNTRACKED

    def evict(self, n: int, pins: np.ndarray) -> np.ndarray:
        n = check_evict_n(n)
        pins = check_pins(pins, self._n)
        if n == 0 or n > self._log.size:
            return EMPTY.copy()
        cand = self._log.candidates(n, pins)
        if cand.slots.size < n:
            return EMPTY.copy()
        self._log.commit(n, cand)
        return cand.slots

    def evict_up_to(self, n: int, pins: np.ndarray) -> np.ndarray:
        """Like ``evict`` but takes what it can: at most ``n`` unpinned slots, oldest first."""
        n = check_evict_n(n)
        pins = check_pins(pins, self._n)
        if n == 0 or self._log.size == 0:
            return EMPTY.copy()
        cand = self._log.candidates(n, pins)
        self._log.commit(cand.slots.size, cand)
        return cand.slots

    @property
    def num_slots(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self._log.size

    def stamp_of(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: >= 0 when tracked, -1 when not (vectorized membership)."""
        return self._stamp[slots]

    def __contains__(self, slot: object) -> bool:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self._n:
            return False
        return bool(self._stamp[slot] != UNTRACKED)

    def order(self) -> list[int]:
        return self._log.live().tolist()

    @property
    def nbytes(self) -> int:
        return self._stamp.nbytes + self._log.nbytes
