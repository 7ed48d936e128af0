"""Least-recently-used eviction over compact per-slot linked lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from .base import NIL, EvictionPolicy, SlotLists, check_evict_n, check_num_slots

_LRU = 1  # the single list id


class LRUPolicy(EvictionPolicy):
    """Plain LRU: evicts the least recently inserted-or-touched unprotected slot first.

    Prefix semantics: callers touch (and insert) a request's blocks
    last-block-first, so the request's first block ends up most recent. LRU
    then evicts a prefix from its tail towards its head, and what survives is
    always a usable leading prefix of the request.

    Memory: 9 bytes per slot (two int32 links and a membership byte), no
    Python object per slot; the key passed to insert is not kept.
    """

    name: ClassVar[str] = "lru"

    __slots__ = ("_n", "_lists")

    def __init__(self, num_slots: int) -> None:
        self._n = check_num_slots(num_slots)
        self._lists = SlotLists(num_slots, 1)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self._n:
            raise ValueError(f"slot {slot} out of range for a policy of {self._n} slots")

    def insert(self, slot: int, key: bytes) -> None:
        self._check(slot)
        if self._lists.owner[slot]:
            raise ValueError(f"slot {slot} is already tracked by the {self.name} policy")
        self._lists.push_mru(_LRU, slot)

    def touch(self, slot: int) -> None:
        self._check(slot)
        lists = self._lists
        if lists.owner[slot] and lists.tail[_LRU] != slot:
            lists.unlink(slot)
            lists.push_mru(_LRU, slot)

    def remove(self, slot: int) -> None:
        self._check(slot)
        if self._lists.owner[slot]:
            self._lists.unlink(slot)

    def evict(self, n: int, protected: Callable[[int], bool]) -> list[int]:
        check_evict_n(n)
        lists = self._lists
        if n == 0 or n > lists.size[_LRU]:
            return []
        # Select first, without mutating: the walk costs n + protected slots skipped.
        victims: list[int] = []
        nxt = lists.nxt
        slot = lists.head[_LRU]
        while slot != NIL:
            if not protected(slot):
                victims.append(slot)
                if len(victims) == n:
                    break
            slot = nxt[slot]
        if len(victims) < n:
            return []
        for slot in victims:
            lists.unlink(slot)
        return victims

    def __len__(self) -> int:
        return self._lists.size[_LRU]

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self._n and self._lists.owner[slot] != 0

    def order(self) -> list[int]:
        return self._lists.walk(_LRU)
