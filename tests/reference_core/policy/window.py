"""Reference model of the adaptive-window policy (tiered_kv/policy.py says what it does), in numpy."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from tiered_kv.errors import ConfigError

from .arc import ARCPolicy, KeyTag
from .base import UNTRACKED, check_num_slots, stamp_dtype
from .ghosts import GhostLists
from .recency import RecencyLog

_WINDOW, _MAIN = 0, 1
_SLACK = 16
START, LOW, HIGH = 0.1, 0.05, 0.2  # the window's target: initial, least, most, as shares of the tier
GHOSTS = (4, 2)  # each ghost list's bound (window's, main's), in multiples of the tier's slots
GHOST_BYTES_PER_SLOT = sum(GHOSTS) * 40  # at the bound, ~36 bytes a ghost (rounded up): the config's memory check


class WindowGhosts(GhostLists):
    """GhostLists with a bound per list: the window's ghosts (list 0) and main's (list 1).

    Adding a batch equals adding its tags one by one, each list dropping its
    oldest ghost while over its bound; that is two counts and at most two
    pops per batch, vectorized, where ARC's shared bound decides per victim.
    """

    __slots__ = ("bounds",)

    def __init__(self, window: int, main: int) -> None:
        super().__init__(window + main)
        self.bounds = (window, main)

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

    ``start``, ``low``, ``high``: the window's initial, least and most target, as shares of the tier.
    ``key_tag`` as for ARCPolicy: uint64 tags of the keys slots hold, for the ghosts.
    """

    name: ClassVar[str] = "window"

    __slots__ = ("_low", "_high")

    def __init__(self, num_slots: int, *, key_tag: KeyTag | None = None, start: float = START,
                 low: float = LOW, high: float = HIGH) -> None:  # fmt: skip
        # Not ARCPolicy.__init__: it would allocate ARC's ghost lists only to replace them.
        for name, v in (("start", start), ("low", low), ("high", high)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(f"window policy: {name} must be a share of the tier in [0, 1], got {v!r}")
        if not low <= start <= high:
            raise ConfigError(f"window policy: need low <= start <= high, got {low}, {start}, {high}")
        self._n = check_num_slots(num_slots)
        capacity = num_slots + num_slots // 4 + _SLACK
        self._stamp = np.full(num_slots, UNTRACKED, dtype=stamp_dtype(2 * capacity + 1))
        self._t = (
            RecencyLog(self._stamp, _WINDOW, 2, capacity),
            RecencyLog(self._stamp, _MAIN, 2, capacity),
        )
        self._ghosts = WindowGhosts(GHOSTS[0] * num_slots, GHOSTS[1] * num_slots)
        self._key_tag = key_tag
        self._p = float(start * num_slots)
        self._low, self._high = float(low * num_slots), float(high * num_slots)

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
        self._p = min(self._high, max(self._low, self._p + in_window - in_main))

    def demote(self, slots: np.ndarray) -> None:
        """Forget slots whose block moved up to a faster tier (a hit): remembered as main's ghosts.

        The block was referenced again, so when it comes back (stored once more after
        the faster tier evicts it) it goes straight to main rather than the window.
        """
        s, _ = self._tracked(slots)
        if s.size == 0:
            return
        s = s[np.sort(np.unique(s, return_index=True)[1])]  # each slot once, in the given order
        tags = self._tags(s)
        self.remove(s)
        self._ghosts.add(tags, np.full(s.size, _MAIN, dtype=np.int64))

