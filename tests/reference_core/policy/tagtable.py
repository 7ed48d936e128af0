"""A numpy hash table from uint64 tags to small non-negative ints, probed a batch at a time.

ARC's ghost lists need "is this tag a ghost, and where" for a batch of tags.
A dict of Python ints costs ~100 bytes per entry; this costs 2 entries of
8 + 4 bytes per stored tag (load <= 1/2) and one byte per 8 entries.

Layout: ``nb`` buckets of ``_WIDTH`` entries (one 64-byte row of keys per
bucket), so a lookup is one gather of a row and one vectorized compare. An
unused entry holds the key ``NO_KEY`` (callers never store that tag). A full
bucket spills into the next one (linear probing by bucket) and is flagged
``spilled``; a lookup goes on past a bucket only if it is flagged, so a miss
usually costs one row too. Deleting an entry frees it at once (no tombstone);
flags are only cleared by a rebuild, which runs once an eighth of the
buckets carry one. Callers may keep an entry's flat index (``bucket * 8 +
column``) to reach it without hashing; it is stable until a rebuild, which
``rebuilds`` counts.

Buckets come from the high bits of ``tag * odd`` with a per-process random
odd multiplier, so sequential tags (slot ids) spread and crafted ones cannot
be aimed at one bucket.
"""

from __future__ import annotations

import secrets

import numpy as np

_WIDTH = 8
_U32 = np.uint64(32)
NO_KEY = np.uint64(2**64 - 1)


class TagTable:
    """Distinct uint64 tags (never ``NO_KEY``) -> ints in ``0..max_val``; holds up to ``capacity`` tags."""

    __slots__ = ("_nb", "_keys", "_vals", "_kflat", "_vflat", "_spilled", "_mult", "live", "_flags", "rebuilds")

    def __init__(self, capacity: int, max_val: int) -> None:
        self._nb = max(1, -(-2 * capacity // _WIDTH))
        self._keys = np.full((self._nb, _WIDTH), NO_KEY, dtype=np.uint64)
        self._vals = np.zeros((self._nb, _WIDTH), dtype=np.int32 if max_val < 2**31 else np.int64)
        self._kflat, self._vflat = self._keys.reshape(-1), self._vals.reshape(-1)  # views: entry = b * 8 + col
        self._spilled = np.zeros(self._nb, dtype=np.uint8)
        self.rebuilds = 0
        self._mult = np.uint64(secrets.randbits(64) | 1)
        self.live = 0
        self._flags = 0  # buckets flagged spilled

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes + self._spilled.nbytes

    def _buckets(self, tags: np.ndarray) -> np.ndarray:
        high = (tags * self._mult) >> _U32
        return ((high * np.uint64(self._nb)) >> _U32).astype(np.intp)

    def _probe(self, b: np.ndarray, tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Column of each tag in bucket ``b`` (-1 if not there), and whether to go on to the next bucket."""
        match = self._keys.take(b, axis=0) == tags[:, None]  # take: faster than fancy indexing
        hit = match.view(np.uint64)[:, 0] != 0  # a row of 8 bools read as one uint64
        col = np.where(hit, match.argmax(axis=1), -1)
        return col, self._spilled.take(b) > hit

    def locate(self, tags: np.ndarray) -> np.ndarray:
        """The entry (a flat index, stable until a rebuild) holding each tag; -1 where absent."""
        bucket = self._buckets(tags)
        col, on = self._probe(bucket, tags)
        todo = on.nonzero()[0]
        while todo.size:
            b = (bucket[todo] + 1) % self._nb
            c, on = self._probe(b, tags[todo])
            bucket[todo], col[todo] = b, c
            todo = todo[on]
        return np.where(col >= 0, bucket * _WIDTH + col, -1)

    def find(self, tags: np.ndarray) -> np.ndarray:
        """The value stored for each tag, -1 where absent."""
        idx = self.locate(tags)
        return np.where(idx >= 0, self._vflat[idx], -1)

    def values(self, idx: np.ndarray) -> np.ndarray:
        return self._vflat[idx]

    def set_values(self, idx: np.ndarray, vals: np.ndarray) -> None:
        self._vflat[idx] = vals

    def used(self, idx: np.ndarray) -> np.ndarray:
        """Whether each entry holds a tag."""
        return self._kflat[idx] != NO_KEY

    def keys_at(self, idx: np.ndarray) -> np.ndarray:
        return self._kflat[idx]

    def delete(self, tags: np.ndarray) -> None:
        """Forget distinct tags (absent ones are ignored)."""
        idx = self.locate(tags)
        self.delete_at(idx[idx >= 0])

    def delete_at(self, idx: np.ndarray) -> None:
        """Free these distinct, used entries."""
        self._kflat[idx] = NO_KEY
        self.live -= idx.size

    def insert(self, tags: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """Add tags that are absent and distinct (the caller guarantees both); returns their entries.

        May rebuild the table first, which moves every entry: ``rebuilds`` counts them.
        """
        if self.live + tags.size > self._nb * _WIDTH // 2:
            raise RuntimeError(f"tag table over half full: {self.live} + {tags.size} tags")
        if 8 * self._flags > self._nb:
            self._rebuild()
        out = np.empty(tags.size, dtype=np.int64)
        self._place(tags, vals, self._buckets(tags), np.arange(tags.size), out)
        return out

    def live_entries(self) -> np.ndarray:
        return (self._kflat != NO_KEY).nonzero()[0]

    def _place(self, tags: np.ndarray, vals: np.ndarray, b: np.ndarray, ix: np.ndarray, out: np.ndarray) -> None:
        """Put ``tags[i]`` in the first free entry from bucket ``b[i]`` on; its entry goes to ``out[ix[i]]``."""
        keys, table, spilled = self._keys, self._vals, self._spilled
        while tags.size:
            free = keys.take(b, axis=0) == NO_KEY
            has = free.view(np.uint64)[:, 0] != 0
            if not has.all():  # full buckets: flag them, try the next one next round
                rest = ~has
                full = b[rest]
                self._flags += int(np.count_nonzero(spilled[full] == 0))
                spilled[full] = 1
                later = (tags[rest], vals[rest], (full + 1) % self._nb, ix[rest])
                tags, vals, b, ix, free = tags[has], vals[has], b[has], ix[has], free[has]
            else:
                later = None
            c = free.argmax(axis=1)
            keys[b, c] = tags
            # Two tags aimed at one entry: the last write kept its key, the others try again.
            won = keys[b, c] == tags
            if not won.all():
                lost = ~won
                again = (tags[lost], vals[lost], b[lost], ix[lost])
                tags, vals, b, c, ix = tags[won], vals[won], b[won], c[won], ix[won]
            else:
                again = None
            table[b, c] = vals
            out[ix] = b * _WIDTH + c
            self.live += tags.size
            parts = [p for p in (again, later) if p is not None]
            if not parts:
                return
            tags, vals, b, ix = (np.concatenate(x) for x in zip(*parts, strict=True))

    def _rebuild(self) -> None:
        """Re-place the live tags with no spill flags: each bucket takes its first 8 by rank, at once."""
        self.rebuilds += 1
        ok = self._keys != NO_KEY
        tags, vals = self._keys[ok], self._vals[ok]
        self._keys.fill(NO_KEY)
        self._spilled.fill(0)
        self._flags = 0
        b = self._buckets(tags)
        order = np.argsort(b, kind="stable")
        tags, vals, b = tags[order], vals[order], b[order]
        rank = np.arange(b.size) - np.searchsorted(b, b)
        first = rank < _WIDTH
        self._keys[b[first], rank[first]] = tags[first]
        self._vals[b[first], rank[first]] = vals[first]
        self.live = int(np.count_nonzero(first))
        rest = (~first).nonzero()[0]
        if rest.size:
            full = np.unique(b[rest])
            self._spilled[full] = 1
            self._flags = full.size
            scratch = np.empty(rest.size, dtype=np.int64)
            self._place(tags[rest], vals[rest], (b[rest] + 1) % self._nb, np.arange(rest.size), scratch)
