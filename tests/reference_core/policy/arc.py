"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03) behind the batch interface.

T1 holds blocks seen once, T2 blocks hit at least twice; the ghost lists B1/B2
remember tags of blocks recently evicted from T1/T2. A new block whose tag is
a ghost was evicted too early: a B1 hit grows ``p`` (the target size of T1,
favouring recency), a B2 hit shrinks it (favouring frequency), and the block
goes straight to T2. A scan of one-time keys therefore churns through T1 and
leaves a hot working set in T2.

The manager owns placement and decides when to evict, so this differs from
the paper's REPLACE in two ways: eviction is requested in batches
(``evict(n)``) and never knows the incoming key, and pinned slots are skipped
rather than evicted. A batch behaves exactly like its elements applied one by
one in order.

T1 and T2 are two vectorized recency logs over one stamp array (see
recency.py); ghosts live in numpy arrays (see ghosts.py). Only the ghost
bookkeeping loops in Python, once per ghost hit and once per victim with a
few integer operations. Memory: ~24 bytes per slot (a 4-byte stamp and two
logs of 1.25 * num_slots int64 ids) plus ~36 bytes per ghost, sized for the
bound of num_slots ghosts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from tiered_kv.errors import SlotError

from .base import (
    EMPTY,
    UNTRACKED,
    EvictionPolicy,
    as_slots,
    check_evict_n,
    check_new,
    check_num_slots,
    check_pins,
    distinct_winners,
    stamp_dtype,
)
from .ghosts import GhostLists
from .recency import Candidates, RecencyLog
from .tagtable import NO_KEY

_T1, _T2 = 0, 1
_SLACK = 16

KeyTag = Callable[[np.ndarray], np.ndarray]


class ARCPolicy(EvictionPolicy):
    """ARC with the atomic batch-evict contract of EvictionPolicy.

    ``key_tag(slots)`` returns a uint64 tag per slot for the key the slot
    holds; it is called on insert (ghost hits) and on evict (new ghosts,
    before anything changes), so slots must still hold their keys then.
    Without it the slot id is the tag.
    """

    name: ClassVar[str] = "arc"

    __slots__ = ("_n", "_stamp", "_t", "_ghosts", "_key_tag", "_p")

    def __init__(self, num_slots: int, *, key_tag: KeyTag | None = None) -> None:
        self._n = check_num_slots(num_slots)
        capacity = num_slots + num_slots // 4 + _SLACK
        self._stamp = np.full(num_slots, UNTRACKED, dtype=stamp_dtype(2 * capacity + 1))
        self._t = (RecencyLog(self._stamp, _T1, 2, capacity), RecencyLog(self._stamp, _T2, 2, capacity))
        self._ghosts = GhostLists(num_slots)
        self._key_tag = key_tag
        self._p = 0.0  # adaptive target size of T1, 0 <= p <= num_slots

    # -- introspection (tests, debugging, metrics) ------------------------------------
    @property
    def p(self) -> float:
        return self._p

    def ghost_sizes(self) -> tuple[int, int]:
        """(|B1|, |B2|)."""
        return self._ghosts.size[0], self._ghosts.size[1]

    def ghost_tags(self) -> tuple[list[int], list[int]]:
        """The tags in B1 and B2, oldest first (O(n); for tests and debugging)."""
        return self._ghosts.tags(0), self._ghosts.tags(1)

    def list_sizes(self) -> tuple[int, int]:
        """(|T1|, |T2|)."""
        return self._t[_T1].size, self._t[_T2].size

    @property
    def ghost_nbytes(self) -> int:
        return self._ghosts.nbytes

    @property
    def nbytes(self) -> int:
        return self._stamp.nbytes + self._t[_T1].nbytes + self._t[_T2].nbytes + self._ghosts.nbytes

    # -- the interface -----------------------------------------------------------------
    def _tags(self, slots: np.ndarray) -> np.ndarray:
        if self._key_tag is None:
            return slots.astype(np.uint64)
        tags = np.asarray(self._key_tag(slots))
        if tags.shape != slots.shape or tags.dtype.kind not in "iu":
            raise SlotError(f"key_tag returned {tags.dtype} {tags.shape} for {slots.size} slots")
        # The table reserves the all-ones tag for "unused": fold it onto its neighbour.
        return np.minimum(tags.astype(np.uint64, copy=False), NO_KEY - 1)

    def insert(self, slots: np.ndarray) -> None:
        s = as_slots(slots, self._n)
        check_new(self._stamp, s, self.name)
        if s.size == 0:
            return
        tags = self._tags(s)
        hit, entry = self._ghosts.lookup(tags)
        to_t2 = hit >= 0
        if to_t2.any():
            self._ghost_hits(tags, hit, to_t2)
            self._ghosts.discard_at(entry[to_t2])
        t1, t2 = self._t
        new1, new2 = s[~to_t2], s[to_t2]
        t1.append(new1)
        t2.append(new2)
        t1.size += new1.size
        t2.size += new2.size

    def _ghost_hits(self, tags: np.ndarray, hit: np.ndarray, to_t2: np.ndarray) -> None:
        """Adapt p for each ghost hit in batch order; a tag seen again in the batch is no hit (``to_t2``)."""
        g1, g2 = self._ghosts.size
        p, c = self._p, float(self._n)
        seen: set[int] = set()
        for i in np.flatnonzero(to_t2).tolist():
            tag = int(tags[i])
            if tag in seen:  # the first slot with this tag took the ghost; this one is new
                to_t2[i] = False
                continue
            seen.add(tag)
            if hit[i] == 0:  # evicted from T1 too early: give recency more room
                p = min(c, p + max(1.0, g2 / g1))
                g1 -= 1
            else:  # evicted from T2 too early: give frequency more room
                p = max(0.0, p - max(1.0, g1 / g2))
                g2 -= 1
        self._p = p

    def _tracked(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tracked ones among ``slots``, with their stamps (untracked slots are ignored)."""
        s = as_slots(slots, self._n)
        st = self._stamp[s]
        live = st != UNTRACKED
        return s[live], st[live]

    def touch(self, slots: np.ndarray) -> None:
        s, st = self._tracked(slots)
        if s.size == 0:
            return
        from_t1 = st % 2 == _T1
        t1, t2 = self._t
        repeated = t2.append(s)
        moved = np.unique(s[from_t1]).size if repeated else int(np.count_nonzero(from_t1))
        t1.size -= moved
        t2.size += moved

    def remove(self, slots: np.ndarray) -> None:
        s, st = self._tracked(slots)
        if s.size == 0:
            return
        once = distinct_winners(self._stamp, s)
        in_t2 = int(np.count_nonzero(st[once] % 2 == _T2))
        self._t[_T1].size -= int(np.count_nonzero(once)) - in_t2
        self._t[_T2].size -= in_t2
        self._stamp[s] = UNTRACKED

    def _select(
        self, n: int, pins: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, int, Candidates, int, Candidates]:
        """The next ``n`` victims by the ARC rule and where they come from; empty if fewer. Read-only.

        REPLACE one victim at a time takes from T1 while |T1| (shrinking as it
        gives) exceeds p, then from T2, then from T1 again once T2 runs out.
        So the order is: T1's first ``a``, T2's candidates, T1's remaining ones.
        """
        t1, t2 = self._t
        first = min(n, max(0, math.ceil(t1.size - self._p)))  # what REPLACE takes from T1 first
        c1 = t1.candidates(first, pins)
        a = c1.slots.size
        c2 = t2.candidates(n - a, pins)
        j2 = c2.slots.size
        if a + j2 < n:  # T2 ran out: the rest comes from T1, after its first ``a``
            c1 = t1.candidates(n - j2, pins)
            if c1.slots.size < n - j2:
                return EMPTY, EMPTY, 0, c1, 0, c2
        j1 = n - j2
        victims = np.concatenate((c1.slots[:a], c2.slots[:j2], c1.slots[a:j1]))
        lids = np.concatenate(
            (np.zeros(a, np.int64), np.ones(j2, np.int64), np.zeros(j1 - a, np.int64))
        )
        return victims, lids, j1, c1, j2, c2

    def evict(self, n: int, pins: np.ndarray) -> np.ndarray:
        n = check_evict_n(n)
        pins = check_pins(pins, self._n)
        if n == 0 or n > len(self):
            return EMPTY.copy()
        victims, lids, j1, c1, j2, c2 = self._select(n, pins)
        if victims.size == 0:
            return EMPTY.copy()
        tags = self._tags(victims)  # before any change: key_tag may raise
        self._t[_T1].commit(j1, c1)
        self._t[_T2].commit(j2, c2)
        self._ghosts.add(tags, lids)
        return victims

    @property
    def num_slots(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self._t[_T1].size + self._t[_T2].size

    def __contains__(self, slot: object) -> bool:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < self._n:
            return False
        return bool(self._stamp[slot] != UNTRACKED)

    def order(self) -> list[int]:
        if len(self) == 0:
            return []
        return self._select(len(self), None)[0].tolist()
