"""Reference model of native FreeRuns (native/free_runs.hpp): the free slots as one boolean mask, its runs
found afresh on every call (simple, not fast).

take(m): the longest runs first (lowest start among equally long ones), each taken whole while it fits in
what is still wanted; the rest from the low end of the shortest run that holds it (lowest start among
equals); the slots ascending.
"""

from __future__ import annotations

import numpy as np

from tiered_kv.errors import TieredKVError


def runs_of(free: np.ndarray) -> list[tuple[int, int]]:
    """The maximal runs of True in ``free``, as (start, length), ascending."""
    edges = np.diff(np.concatenate([[0], free.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


class FreeRuns:
    def __init__(self, n: int) -> None:
        self.free = np.ones(n, dtype=bool)

    @property
    def count(self) -> int:
        return int(np.count_nonzero(self.free))

    @property
    def nbytes(self) -> int:
        return 96 * len(self.runs())  # as native: per free run, none per slot

    def runs(self) -> list[tuple[int, int]]:
        return runs_of(self.free)

    def take(self, m: int) -> np.ndarray:
        if m < 0 or m > self.count:
            raise TieredKVError(f"take({m}) of {self.count} free slots")
        out: list[int] = []
        while len(out) < m:
            want = m - len(out)
            runs = self.runs()
            longest = max(n for _, n in runs)
            if longest <= want:
                start, n = min((s, n) for s, n in runs if n == longest)
            else:
                n, start = min((n, s) for s, n in runs if n >= want)
            k = min(n, want)
            out.extend(range(start, start + k))
            self.free[start : start + k] = False
        return np.array(sorted(out), dtype=np.int64)

    def give(self, slots) -> None:
        s = np.asarray(slots, dtype=np.int64)
        if not len(s):
            return
        if self.count + len(s) > len(self.free):
            raise TieredKVError("free runs: more slots freed than exist")
        if s.min() < 0 or s.max() >= len(self.free):
            raise TieredKVError("free runs: a freed slot is out of range")
        if len(np.unique(s)) != len(s) or self.free[s].any():
            raise TieredKVError("free runs: a slot is freed twice")
        self.free[s] = True

    def reset(self, used: np.ndarray) -> None:
        self.free = ~used.astype(bool)
