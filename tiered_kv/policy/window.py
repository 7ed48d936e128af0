"""Adaptive-window LRU: a FIFO window for first-time blocks, an LRU main area, ghosts steer the split.

- A block whose key is not a ghost enters the **window**, a FIFO: it stays in
  insertion order, and its first touch (its second reference) moves it to the
  most recent end of **main**, a plain LRU.
- A block whose key is a ghost (evicted, then stored again) goes straight to
  main and moves the window's target size: a ghost of the window says the
  window was too small (the target grows), a ghost of main says main was too
  small (the target shrinks).
- ``evict(n)`` takes from the window's head while the window holds more than
  its target, then from main's LRU head, and from the other area when one has
  no unpinned candidates left.

That is ARC's structure (T1 = the window, T2 = main, B1/B2 = their ghosts), so
this class reuses ARCPolicy's lists, selection and atomic evict and changes
what ARC leaves to taste: where the target starts (half the slots, not 0), how
far one ghost hit moves it, and it is vectorized where ARC loops per element.

Controller, once per insert batch (a tag repeated in the batch is a hit once):
``target += grow * hits_window - shrink * hits_main``, clipped to
``[0, num_slots]``, where ``grow = max(1, |main ghosts| / |window ghosts|)``
and ``shrink = max(1, |window ghosts| / |main ghosts|)`` are taken at the
batch's start: ARC's step sizes, so the rarer kind of ghost hit moves the
target further. The target starts at half the tier (``START``).

Ghosts: one uint64 key tag each, ~36 bytes (ghosts.py). Each list keeps at
most half the tier (``num_slots`` ghosts in all, like ARC's bound) and drops
its own oldest first, so trimming a batch is two counts and two pops; ARC's
shared bound decides per victim in a Python loop. On the Mooncake trace at
5 % the per-list bound was worth ~0.3 points over ARC's shared one.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..errors import ConfigError
from .arc import ARCPolicy, KeyTag
from .base import UNTRACKED, check_num_slots, stamp_dtype
from .ghosts import GhostLists
from .recency import RecencyLog

_WINDOW, _MAIN = 0, 1
_SLACK = 16
START = 0.5  # the window's initial target, as a share of the tier


class WindowGhosts(GhostLists):
    """GhostLists with a bound per list: the window's ghosts (list 0) and main's (list 1) each keep half.

    Adding a batch equals adding its tags one by one, each list dropping its
    oldest ghost while over its bound; that is two counts and at most two
    pops per batch, vectorized, where ARC's shared bound decides per victim.
    """

    __slots__ = ("bounds",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.bounds = (capacity // 2, capacity - capacity // 2)

    def _add_fresh(self, tags: np.ndarray, lids: np.ndarray) -> None:
        if tags.size == 0:
            return
        lids = lids.astype(np.int64, copy=False)
        keep = None
        for lid in (0, 1):  # two lists: a bounded loop, not one per ghost
            mine = (lids == lid).nonzero()[0]
            over = self.size[lid] + mine.size - self.bounds[lid]
            if over <= 0:
                continue
            old = min(over, self.size[lid])
            if old:
                self._pop_oldest(lid, old)
            if over > old:  # more new ghosts than the bound: the first of them are gone at once
                keep = np.ones(tags.size, dtype=bool) if keep is None else keep
                keep[mine[: over - old]] = False
        if keep is not None:
            tags, lids = tags[keep], lids[keep]
        self._append(tags, lids)


class WindowPolicy(ARCPolicy):
    """The adaptive-window LRU ("window"); see the module docstring.

    ``start`` is the window's initial target as a share of the tier.
    ``key_tag`` as for ARCPolicy: uint64 tags of the keys slots hold, for the ghosts.
    """

    name: ClassVar[str] = "window"

    __slots__ = ()

    def __init__(self, num_slots: int, *, key_tag: KeyTag | None = None, start: float = START) -> None:
        # Not ARCPolicy.__init__: it would allocate ARC's ghost lists only to replace them.
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0 <= start <= 1:
            raise ConfigError(f"window policy: start must be a share of the tier in [0, 1], got {start!r}")
        self._n = check_num_slots(num_slots)
        capacity = num_slots + num_slots // 4 + _SLACK
        self._stamp = np.full(num_slots, UNTRACKED, dtype=stamp_dtype(2 * capacity + 1))
        self._t = (
            RecencyLog(self._stamp, _WINDOW, 2, capacity),
            RecencyLog(self._stamp, _MAIN, 2, capacity),
        )
        self._ghosts = WindowGhosts(num_slots)
        self._key_tag = key_tag
        self._p = float(start * num_slots)

    @property
    def target(self) -> float:
        """The window's target size in slots (ARC's ``p``)."""
        return self._p

    def _ghost_hits(self, tags: np.ndarray, hit: np.ndarray, to_t2: np.ndarray) -> None:
        """Move the target by the batch's ghost hits; a tag repeated in the batch is a hit once (``to_t2``)."""
        idx = np.flatnonzero(to_t2)
        if idx.size > 1:
            _, first = np.unique(tags[idx], return_index=True)
            if first.size < idx.size:
                again = np.ones(idx.size, dtype=bool)
                again[first] = False
                to_t2[idx[again]] = False  # a later slot with a ghost's tag is new: the first took the ghost
                idx = idx[~again]
        in_main = int(np.count_nonzero(hit[idx] == _MAIN))
        in_window = idx.size - in_main
        gw, gm = self._ghosts.size  # before this batch's hits leave them
        grow, shrink = grow_shrink(gw, gm)
        self._p = min(float(self._n), max(0.0, self._p + grow * in_window - shrink * in_main))


def grow_shrink(ghosts_window: int, ghosts_main: int) -> tuple[float, float]:
    """Target move per window-ghost hit and per main-ghost hit: ARC's ratios, at least one slot.

    The rarer kind of ghost hit moves the target further: a hit in the
    shorter ghost list is stronger evidence that its area is too small.
    """
    grow = max(1.0, ghosts_main / ghosts_window) if ghosts_window else 1.0
    shrink = max(1.0, ghosts_window / ghosts_main) if ghosts_main else 1.0
    return grow, shrink
