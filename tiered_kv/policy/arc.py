"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03) over compact slot lists.

T1 holds blocks seen once, T2 blocks hit at least twice; B1/B2 remember the
keys of blocks recently evicted from T1/T2. A new block whose key is in a
ghost list was evicted too early: a B1 hit grows ``p`` (the target size of
T1, favouring recency), a B2 hit shrinks it (favouring frequency). A scan of
one-time keys therefore churns through T1 and leaves a hot working set in T2.

The index owns placement and decides when to evict, so this differs from the
paper's REPLACE in two ways: eviction is requested in batches (``evict(n)``)
and never knows the incoming key, and protected (pinned, in-flight) slots
are skipped rather than evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from .base import NIL, EvictionPolicy, SlotLists, check_evict_n, check_num_slots

_T1 = 1
_T2 = 2


class ARCPolicy(EvictionPolicy):
    """ARC with the atomic batch-evict contract of EvictionPolicy.

    Memory: 17 bytes per slot (two int32 links, a list-id byte, and a reference
    to the key object, which the index shares) plus the ghost lists. Ghosts
    hold evicted keys (OrderedDict, ~100 bytes per entry plus the key object),
    bounded so that ``|B1| + |B2| <= num_slots``.
    """

    name: ClassVar[str] = "arc"

    __slots__ = ("_n", "_lists", "_keys", "_b1", "_b2", "_p")

    def __init__(self, num_slots: int) -> None:
        self._n = check_num_slots(num_slots)
        self._lists = SlotLists(num_slots, 2)
        # The ghost lists need each victim's key; one pointer per slot, no per-slot object.
        self._keys: list[bytes | None] = [None] * num_slots
        self._b1: OrderedDict[bytes, None] = OrderedDict()  # first key = LRU end
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0  # adaptive target size of T1, 0 <= p <= num_slots

    @property
    def p(self) -> float:
        return self._p

    def ghost_sizes(self) -> tuple[int, int]:
        """(|B1|, |B2|)."""
        return len(self._b1), len(self._b2)

    def ghost_keys(self) -> tuple[list[bytes], list[bytes]]:
        """The keys in B1 and B2, oldest first (O(n); for tests and debugging)."""
        return list(self._b1), list(self._b2)

    def list_sizes(self) -> tuple[int, int]:
        """(|T1|, |T2|)."""
        return self._lists.size[_T1], self._lists.size[_T2]

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self._n:
            raise ValueError(f"slot {slot} out of range for a policy of {self._n} slots")

    def insert(self, slot: int, key: bytes) -> None:
        self._check(slot)
        lists = self._lists
        if lists.owner[slot]:
            raise ValueError(f"slot {slot} is already tracked by the {self.name} policy")
        b1, b2 = self._b1, self._b2
        if key in b1:
            # Evicted from T1 too early: give recency more room.
            self._p = min(float(self._n), self._p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            lid = _T2
        elif key in b2:
            # Evicted from T2 too early: give frequency more room.
            self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            lid = _T2
        else:
            lid = _T1
        self._keys[slot] = key
        lists.push_mru(lid, slot)

    def touch(self, slot: int) -> None:
        self._check(slot)
        lists = self._lists
        if lists.owner[slot] and lists.tail[_T2] != slot:
            lists.unlink(slot)
            lists.push_mru(_T2, slot)

    def remove(self, slot: int) -> None:
        self._check(slot)
        if self._lists.owner[slot]:
            self._lists.unlink(slot)
            self._keys[slot] = None

    def _select(self, n: int, protected: Callable[[int], bool]) -> list[int] | None:
        """The next ``n`` victims by the ARC rule, or None if fewer are evictable. Read-only."""
        lists = self._lists
        nxt = lists.nxt
        t1_size = lists.size[_T1]  # a working copy: it shrinks as T1 victims are chosen
        p = self._p
        c1 = lists.first_unprotected(lists.head[_T1], protected)
        c2 = lists.first_unprotected(lists.head[_T2], protected)
        victims: list[int] = []
        while len(victims) < n:
            # ARC's REPLACE: take from T1 while it is above its target (or T2 has nothing to give).
            if c1 != NIL and (t1_size > p or c2 == NIL):
                victims.append(c1)
                t1_size -= 1
                c1 = lists.first_unprotected(nxt[c1], protected)
            elif c2 != NIL:
                victims.append(c2)
                c2 = lists.first_unprotected(nxt[c2], protected)
            else:
                return None
        return victims

    def evict(self, n: int, protected: Callable[[int], bool]) -> list[int]:
        check_evict_n(n)
        lists = self._lists
        if n == 0 or n > lists.size[_T1] + lists.size[_T2]:
            return []
        victims = self._select(n, protected)
        if victims is None:
            return []
        keys = self._keys
        for slot in victims:
            key = keys[slot]
            keys[slot] = None
            if lists.unlink(slot) == _T1:
                self._add_ghost(self._b1, self._b2, key)
            else:
                self._add_ghost(self._b2, self._b1, key)
        return victims

    def _add_ghost(
        self, into: OrderedDict[bytes, None], other: OrderedDict[bytes, None], key: bytes | None
    ) -> None:
        if key is None:
            return
        # A key lives in at most one ghost list, at the MRU end of the list it was evicted from.
        other.pop(key, None)
        into.pop(key, None)
        into[key] = None
        # Bound |B1| + |B2| <= num_slots: drop the oldest ghost of the longer list (a tie
        # spares the list just added to), which sheds scan keys (B1) before the memory of
        # a hot set evicted from T2.
        while len(into) + len(other) > self._n:
            (into if len(into) > len(other) else other).popitem(last=False)

    def __len__(self) -> int:
        return self._lists.size[_T1] + self._lists.size[_T2]

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self._n and self._lists.owner[slot] != 0

    def order(self) -> list[int]:
        victims = self._select(len(self), lambda _slot: False)
        return victims if victims is not None else []
