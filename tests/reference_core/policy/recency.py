"""A recency list of slots kept as an append-only log, so that every operation is a few numpy calls.

A linked list moves one slot per Python step (~0.3 us each) while a 16 KiB
block copies in under a microsecond, so the bookkeeping would cost a large
share of the copy. Instead each list is a log of slot ids in use order, oldest first, and a
per-slot ``stamp`` array says which log entry is the slot's live one:

- ``stamp[s] == pos * nlists + lid`` when ``log[pos]`` of list ``lid`` is slot
  ``s``'s live entry; ``-1`` when ``s`` is untracked. Several lists (ARC's T1
  and T2) share one stamp array, so a slot is in at most one of them.
- Insert and touch append the batch at the tail and restamp it, in one
  vectorized write; the slot's older entry becomes stale (its stamp moved on).
  Within a batch the LAST occurrence of a slot wins, so the last element ends
  most recent.
- Remove sets the stamp to -1; the log entry goes stale in place.
- Eviction scans from the head in vectorized chunks, keeping entries that are
  live and unpinned until it has n. Stale entries are passed over and dropped
  when the head moves past them. Live but pinned entries that the scan passed
  stay in the list, in their order, ahead of everything newer: they are moved
  up to sit just before the new head, so the next scan starts at them without
  rereading the stale entries that were between them. The eviction order is
  therefore exactly LRU-skipping-pinned.
- When an append does not fit, the log is compacted (live entries, in order,
  to the front; stamps renumbered), which keeps stamps below the log length.
  Capacity is at least ``live + slack``, so a compaction runs at most once per
  ``slack`` appends and costs O(log length): amortized O(1) per slot.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .base import UNTRACKED, last_occurrences, unpinned

_MIN_CHUNK = 16


class Candidates(NamedTuple):
    """The first evictable entries of one list, found without changing anything."""

    slots: np.ndarray  # int64, oldest first
    positions: np.ndarray  # their log positions
    pinned: np.ndarray  # log positions of live, pinned entries the scan passed


class RecencyLog:
    """One recency list over a shared stamp array; ``size`` is kept by the owning policy."""

    __slots__ = ("stamp", "log", "lid", "nlists", "head", "tail", "size")

    def __init__(self, stamp: np.ndarray, lid: int, nlists: int, capacity: int) -> None:
        self.stamp = stamp
        # int64 although ids fit int32: numpy gathers with an int32 index array ~5x slower.
        self.log = np.zeros(capacity, dtype=np.int64)
        self.lid = lid
        self.nlists = nlists
        self.head = 0  # no live entry of this list sits before head
        self.tail = 0
        self.size = 0

    @property
    def nbytes(self) -> int:
        return self.log.nbytes

    def codes(self, start: int, stop: int) -> np.ndarray:
        """The stamp a live entry at each position of ``start..stop-1`` carries."""
        pos = np.arange(start, stop, dtype=np.int64)
        if self.nlists == 1:
            return pos
        return pos * self.nlists + self.lid

    def append(self, slots: np.ndarray) -> bool:
        """Make ``slots`` the most recent of this list, last one newest; True if the batch repeated a slot."""
        if slots.size == 0:
            return False
        m = slots.size
        if self.tail + m > self.log.size:
            slots = self._make_room(slots)
        a, b = self.tail, self.tail + slots.size
        self.log[a:b] = slots
        codes = self.codes(a, b)
        stamp = self.stamp
        stamp[slots] = codes
        self.tail = b
        if np.logical_and.reduce(stamp[slots] == codes):
            return slots.size < m  # _make_room dropped repeats
        # A repeated slot got one of its codes, not necessarily the last: the latest position wins.
        np.maximum.at(stamp, slots, codes.astype(stamp.dtype))
        return True

    def _make_room(self, slots: np.ndarray) -> np.ndarray:
        # These slots are about to be re-appended: their current entries can go now.
        self.stamp[slots] = UNTRACKED
        self.compact()
        if self.tail + slots.size > self.log.size:
            slots = last_occurrences(slots)
        if self.tail + slots.size > self.log.size:
            raise RuntimeError(
                f"recency log overflow: {self.tail} live + {slots.size} new > {self.log.size} entries"
            )
        return slots

    def compact(self) -> None:
        """Move the live entries, in order, to the front of the log and renumber their stamps."""
        h, t = self.head, self.tail
        seg = self.log[h:t]
        live = seg[self.stamp[seg] == self.codes(h, t)]
        self.log[: live.size] = live
        self.stamp[live] = self.codes(0, live.size)
        self.head, self.tail = 0, live.size

    def candidates(self, n: int, pins: np.ndarray | None) -> Candidates:
        """Up to ``n`` live, unpinned slots from the oldest end, with their positions. Read-only."""
        if n <= 0 or self.size == 0:
            return _NONE
        found_s: list[np.ndarray] = []
        found_p: list[np.ndarray] = []
        pinned: list[np.ndarray] = []
        need = n
        pos, chunk = self.head, n + n // 2 + _MIN_CHUNK
        while need > 0 and pos < self.tail:
            end = min(self.tail, pos + chunk)
            seg = self.log[pos:end]
            live = self.stamp[seg] == self.codes(pos, end)
            free = unpinned(pins, seg, live)
            idx = free.nonzero()[0][:need]
            if idx.size:
                found_s.append(seg[idx])
                found_p.append(idx + pos)
                need -= idx.size
            if free is not live:
                held = (live ^ free).nonzero()[0]
                if held.size:
                    pinned.append(held + pos)
            pos, chunk = end, chunk * 2
        return Candidates(_cat(found_s), _cat(found_p), _cat(pinned))

    def commit(self, j: int, cand: Candidates) -> None:
        """Remove the first ``j`` candidates (which must be current) and move the head past them."""
        if j == 0:
            return
        self.stamp[cand.slots[:j]] = UNTRACKED
        self.size -= j
        end = int(cand.positions[j - 1]) + 1
        held = cand.pinned[cand.pinned < end] if cand.pinned.size else cand.pinned
        if held.size:
            # Pinned entries the scan passed keep their order, just before the new head.
            keep = self.log[held]
            start = end - held.size
            self.log[start:end] = keep
            self.stamp[keep] = self.codes(start, end)
            end = start
        self.head = end

    def live(self) -> np.ndarray:
        """Every live slot of this list, oldest first."""
        seg = self.log[self.head : self.tail]
        return seg[self.stamp[seg] == self.codes(self.head, self.tail)]


_NONE = Candidates(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
