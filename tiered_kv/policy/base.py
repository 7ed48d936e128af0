"""The eviction-policy interface and the compact slot lists its implementations share.

A tier has ``num_slots`` integer slots. The index decides which slots hold
resident blocks; a policy only orders them for eviction. A 1 TB tier holds
~64M blocks, so a policy must not keep a Python object per slot: recency
lists are doubly linked through flat ``array('i')`` prev/next arrays indexed
by slot, plus one byte per slot saying which list (if any) holds the slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable
from typing import ClassVar

NIL = -1
# array('i') stores C ints; slot ids must fit in them.
MAX_SLOTS = 2**31 - 1


class EvictionPolicy(ABC):
    """Orders a tier's resident slots for eviction.

    All methods are synchronous and meant for the event-loop thread (no locks).
    A slot outside ``0..num_slots-1`` is a caller bug and raises ValueError;
    an in-range slot that is not tracked is a no-op for touch/remove.
    """

    name: ClassVar[str]

    @abstractmethod
    def __init__(self, num_slots: int) -> None: ...

    @abstractmethod
    def insert(self, slot: int, key: bytes) -> None:
        """Track a newly resident block as most recent; ValueError if ``slot`` is already tracked."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """Record a hit on a resident block; untracked slot: no-op."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """Forget a block dropped without eviction (deleted, corrupt); untracked slot: no-op."""

    @abstractmethod
    def evict(self, n: int, protected: Callable[[int], bool]) -> list[int]:
        """Remove and return exactly ``n`` unprotected slots in eviction order, or ``[]``.

        Atomic: when fewer than ``n`` tracked slots have ``protected(slot)`` False,
        returns ``[]`` and changes nothing. Candidates are selected before any
        mutation, so an exception raised by ``protected`` also leaves the policy intact.
        """

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, slot: object) -> bool: ...

    @abstractmethod
    def order(self) -> list[int]:
        """Full eviction order, first = next victim (O(n); for tests and debugging)."""


def check_num_slots(num_slots: int) -> int:
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or not 0 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"num_slots must be an int in 0..{MAX_SLOTS}, got {num_slots!r}")
    return num_slots


def check_evict_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"evict(n): n must be >= 0, got {n}")


class SlotLists:
    """Several disjoint doubly linked lists over slots 0..num_slots-1, in ~9 bytes/slot.

    ``owner[slot]`` is the id (1..num_lists) of the list holding the slot, 0 if none.
    Each list runs from ``head`` (least recent, next victim) to ``tail`` (most recent);
    ``nxt`` points towards the most-recent end. Every operation is O(1).
    """

    __slots__ = ("prev", "nxt", "owner", "head", "tail", "size")

    def __init__(self, num_slots: int, num_lists: int) -> None:
        self.prev = array("i", [NIL]) * num_slots
        self.nxt = array("i", [NIL]) * num_slots
        self.owner = bytearray(num_slots)
        # index 0 is unused so a list id doubles as the index.
        self.head = [NIL] * (num_lists + 1)
        self.tail = [NIL] * (num_lists + 1)
        self.size = [0] * (num_lists + 1)

    def push_mru(self, lid: int, slot: int) -> None:
        tail = self.tail[lid]
        self.prev[slot] = tail
        self.nxt[slot] = NIL
        if tail == NIL:
            self.head[lid] = slot
        else:
            self.nxt[tail] = slot
        self.tail[lid] = slot
        self.owner[slot] = lid
        self.size[lid] += 1

    def unlink(self, slot: int) -> int:
        """Take ``slot`` out of its list (it must be in one); returns that list's id."""
        lid = self.owner[slot]
        p = self.prev[slot]
        n = self.nxt[slot]
        if p == NIL:
            self.head[lid] = n
        else:
            self.nxt[p] = n
        if n == NIL:
            self.tail[lid] = p
        else:
            self.prev[n] = p
        self.owner[slot] = 0
        self.size[lid] -= 1
        return lid

    def first_unprotected(self, slot: int, protected: Callable[[int], bool]) -> int:
        """From ``slot`` towards the MRU end, the first slot not protected (or NIL). Read-only."""
        nxt = self.nxt
        while slot != NIL and protected(slot):
            slot = nxt[slot]
        return slot

    def walk(self, lid: int) -> list[int]:
        out = []
        slot = self.head[lid]
        while slot != NIL:
            out.append(slot)
            slot = self.nxt[slot]
        return out
