"""ARC's ghost lists B1 and B2: tags of recently evicted blocks, oldest first, in fixed-size arrays.

A ghost is a uint64 tag (the manager's KeyTable tag of the evicted key), never
the key object. A TagTable maps each ghost's tag to ``pos * 2 + lid``: its
place in a log shared by both lists and its list (0 = B1, 1 = B2). The log
holds, oldest first, the table entry of each ghost, so popping the oldest
ghosts reads the log and the table's entries directly with no hashing; only
lookups by tag (an insert's ghost hits, an evicted tag already a ghost) hash.

A log entry is live while its table entry is used and still carries the
entry's own ``pos * 2 + lid``; a ghost hit frees the table entry and leaves
the log entry stale in place. Each list keeps its own head, and popping scans
from it past stale entries and the other list's. The log compacts (live
entries to the front, values renumbered) when an append does not fit, at most
once per ``capacity // 2`` appends; when the table rebuilds (entries move), the
log is repointed from the table's values in one vectorized write.

Memory at the bound (capacity ghosts): table 2 entries * 12 bytes + log
1.5 entries * 8 bytes = ~36 bytes per ghost.
"""

from __future__ import annotations

import numpy as np

from .tagtable import TagTable

_SLACK = 16


class GhostLists:
    """B1 (list 0) and B2 (list 1), bounded so that ``|B1| + |B2| <= capacity``."""

    __slots__ = ("capacity", "size", "_log", "_table", "_head", "_tail")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = [0, 0]
        # Trims run before appends, so live + new <= capacity: after a compaction at least
        # capacity // 2 entries are free. int64 entries: numpy gathers by int32 index ~5x slower.
        length = capacity + capacity // 2 + _SLACK
        self._table = TagTable(capacity, 2 * length + 1)
        self._log = np.zeros(length, dtype=np.int64)
        self._head = [0, 0]
        self._tail = 0

    @property
    def nbytes(self) -> int:
        return self._log.nbytes + self._table.nbytes

    def lookup(self, tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(list, entry) of each tag: list 0 or 1 and its table entry, or -1 and -1 where it is no ghost."""
        idx = self._table.locate(tags)
        lid = np.where(idx >= 0, self._table.values(idx) & 1, -1)
        return lid, idx

    def discard_at(self, idx: np.ndarray) -> None:
        """Forget the ghosts at these distinct table entries (from ``lookup``): ghost hits."""
        in_b2 = int(np.count_nonzero(self._table.values(idx) & 1))
        self.size[0] -= idx.size - in_b2
        self.size[1] -= in_b2
        self._table.delete_at(idx)

    def add(self, tags: np.ndarray, lids: np.ndarray) -> None:
        """Add evicted tags at the newest end of list ``lids[i]``, one by one in order, trimming to the bound.

        Same result as adding them one at a time: a tag that is already a ghost
        moves to the newest end of its new list, and after each add the oldest
        ghost of the longer list (the other list on a tie) goes while the bound
        is exceeded, which sheds scan tags (B1) before a hot set's (B2).
        """
        if tags.size == 0:
            return
        # Rare (duplicate keys or a tag collision): a tag that is already a ghost, or repeats an
        # earlier one of the batch. Those go one at a time; the runs between them as batches.
        again = self._table.locate(tags) >= 0
        if tags.size > 1:
            order = np.argsort(tags, kind="stable")
            ordered = tags[order]
            again[order[1:][ordered[1:] == ordered[:-1]]] = True
        start = 0
        for i in again.nonzero()[0].tolist():
            self._add_fresh(tags[start:i], lids[start:i])
            _, idx = self.lookup(tags[i : i + 1])
            if idx[0] >= 0:
                self.discard_at(idx)
            self._add_fresh(tags[i : i + 1], lids[i : i + 1])
            start = i + 1
        self._add_fresh(tags[start:], lids[start:])

    def _add_fresh(self, tags: np.ndarray, lids: np.ndarray) -> None:
        # Count the trims the one-by-one adds would make, then apply them as batches: a list
        # loses its oldest ghosts, and only once those run out the first of its new ones.
        if tags.size == 0:
            return
        g, pops, cap = list(self.size), [0, 0], self.capacity
        lids = lids.astype(np.int64, copy=False)
        if g[0] + g[1] + tags.size <= cap:  # room for all: no trims
            self._append(tags, lids)
            return
        # Until the bound is reached an add trims nothing; after it each add trims one ghost, and
        # only d = |B1| - |B2| decides which: the list just added to, unless it is the shorter.
        seq = lids.tolist()
        room = cap - g[0] - g[1]
        for lid in seq[:room]:
            g[lid] += 1
        d = g[0] - g[1]
        for lid in seq[max(room, 0) :]:
            if lid == 0:
                if d >= 0:
                    pops[0] += 1
                else:
                    d += 2
                    pops[1] += 1
            elif d <= 0:
                pops[1] += 1
            else:
                d -= 2
                pops[0] += 1
        keep = np.ones(tags.size, dtype=bool)
        for lid in (0, 1):
            old = min(pops[lid], self.size[lid])
            if old:
                self._pop_oldest(lid, old)
            if pops[lid] > old:
                keep[(lids == lid).nonzero()[0][: pops[lid] - old]] = False
        self._append(tags[keep], lids[keep])

    def _live(self, start: int, stop: int, lid: int | None) -> np.ndarray:
        """Which log entries in ``start..stop-1`` are live (of list ``lid``, or either when None)."""
        ent = self._log[start:stop]
        vals = self._table.values(ent)
        pos = np.arange(start, stop, dtype=np.int64)
        mine = (vals >> 1) == pos if lid is None else vals == pos * 2 + lid
        return mine & self._table.used(ent)

    def _append(self, tags: np.ndarray, lids: np.ndarray) -> None:
        m = tags.size
        if m == 0:
            return
        if self._tail + m > self._log.size:
            self._compact()
        a, table = self._tail, self._table
        rebuilds = table.rebuilds
        ent = table.insert(tags, np.arange(a, a + m, dtype=np.int64) * 2 + lids)
        if table.rebuilds != rebuilds:  # every entry moved: repoint the log from the values
            moved = table.live_entries()
            self._log[table.values(moved) >> 1] = moved
        self._log[a : a + m] = ent
        self._tail = a + m
        in_b2 = int(np.count_nonzero(lids))
        self.size[0] += m - in_b2
        self.size[1] += in_b2

    def _pop_oldest(self, lid: int, k: int) -> None:
        need, pos, chunk = k, self._head[lid], k + k // 4 + 16
        while need:
            if pos >= self._tail:
                raise RuntimeError(f"ghost list {lid}: {need} ghosts missing from the log")
            end = min(self._tail, pos + chunk)
            idx = self._live(pos, end, lid).nonzero()[0][:need]
            if idx.size:
                self._table.delete_at(self._log[pos + idx])
                need -= idx.size
            pos = pos + int(idx[-1]) + 1 if need == 0 else end
            chunk *= 2
        self._head[lid] = pos
        self.size[lid] -= k

    def _compact(self) -> None:
        h, t = min(self._head), self._tail
        keep = self._log[h:t][self._live(h, t, None)]
        lids = self._table.values(keep) & 1
        self._log[: keep.size] = keep
        self._table.set_values(keep, np.arange(keep.size, dtype=np.int64) * 2 + lids)
        self._tail = keep.size
        self._head = [0, 0]

    def tags(self, lid: int) -> list[int]:
        """The tags in list ``lid``, oldest first (O(log); for tests and debugging)."""
        h, t = self._head[lid], self._tail
        ent = self._log[h:t][self._live(h, t, lid)]
        return [int(x) for x in self._table.keys_at(ent)]

