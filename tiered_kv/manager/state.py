"""What the tier manager's parts share: the tiers' indexes, staging rows, sessions, events, and what
the manager knows of the tiers below it (is the disk writable, what does the remote tier hold).

The manager (manager.py) builds one ``TierState`` and hands it to its parts: the store planner
(storing.py), the load planner (loading.py) and the room finder (spills.py), which the runners
(transfer/runners/) call directly. They run one call at a time: on the loop thread, or on vLLM's
scheduler thread while it holds the cache's state lock (state_lock.py), which parks the loop between
its callbacks. Only the manager's own methods change the flags here: the cache reports a degraded
disk or an attached remote tier through ``TierManager``, never by setting them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..core import core
from .plans import Located
from .sessions import Sessions
from .tier_index import TierIndex


class Staging:
    """Slab rows past the CPU tier's slots, for exclusive loads.

    An exclusive load reads its disk and remote hits into these rows and copies them on to
    the engine, which keeps the blocks: the load then displaces no CPU block (and so
    pushes nothing out of the disk), as moving a block up one exclusive hierarchy should.
    """

    def __init__(self, first: int, count: int) -> None:
        self.count = count
        self._free = np.arange(first + count - 1, first - 1, -1, dtype=np.int64)  # popped ascending
        self._n = count

    @property
    def in_use(self) -> int:
        return self.count - self._n

    def take(self, n: int) -> np.ndarray:
        k = min(n, self._n)
        out = np.sort(self._free[self._n - k : self._n])
        self._n -= k
        return out

    def give(self, slots: np.ndarray) -> None:
        k = len(slots)
        self._free[self._n : self._n + k] = np.sort(slots)[::-1]
        self._n += k


class TierState:
    """The CPU tier, an optional disk tier below it (with ``domain``, the one policy over both) and
    the remote tier as far as the manager sees it: ``remote_known(rows) -> bool[n]``, or None."""

    def __init__(
        self,
        cpu: TierIndex,
        disk: TierIndex | None,
        domain: object | None,
        key_bytes: int,
        *,
        staging_slots: int,
        protect_share: float,
        session_idle_s: float,
        max_events: int,
        on_event: Callable[[str, str, int], None] | None,
    ) -> None:
        self.key_bytes = key_bytes
        self.cpu, self.disk, self.domain = cpu, disk, domain
        self.disk_writable = disk is not None  # False for good once the disk tier degrades
        self.remote_known: Callable[[np.ndarray], np.ndarray] | None = None
        self.remote_write: str | None = None  # "write_through" | "write_back" while a remote tier is attached
        slots = cpu.num_slots + (disk.num_slots if disk is not None else 0)
        self.sessions = Sessions(key_bytes, max_protected=int(protect_share * slots), idle_s=session_idle_s)
        # Slab rows cpu_slots .. cpu_slots + staging_slots - 1: exclusive loads stage through them.
        self.staging = Staging(cpu.num_slots, staging_slots) if staging_slots > 0 else None
        self.announced: dict[bytes, int] = {}  # keys a store has announced but not yet placed: in flight
        self.disk_invalidate: list[
            np.ndarray
        ] = []  # disk slots dropped for good: the disk store forgets them
        # The core's fused entry points for the common cases (a lookup, a store into a CPU tier with
        # nothing below it): one native call each. The general paths give the same answers.
        self.fused = True
        self._events: deque[tuple[str, str, np.ndarray]] = deque(maxlen=max_events)
        self._on_event = on_event  # (kind, tier, count): the cache's metrics

    def room_may_free(self, *, staging: bool = False) -> bool:
        """Whether room that no plan found may still come free: CPU slots other calls hold (reserved
        for their copies, or pinned while read), and with ``staging`` the staging rows in use."""
        cpu = self.cpu
        return bool(
            cpu.n_reserved or cpu.n_ready_pinned or (staging and self.staging is not None and self.staging.in_use)
        )

    def locate(self, rows: np.ndarray) -> Located:
        """Each key's CPU slot and state; for a key with no CPU entry (in any state: one in flight
        into the CPU tier is waited for, even if it is elsewhere too), its disk slot and state.
        One native call over both tiers."""
        return Located(*core.locate(self.cpu, self.disk, rows))

    def remote_hits(self, rows: np.ndarray) -> np.ndarray:
        """Which rows the remote tier is believed to hold (all False without one, or degraded)."""
        known = self.remote_known
        return known(rows) if known is not None and len(rows) else np.zeros(len(rows), dtype=bool)

    def mark_announced(self, keys: Sequence[bytes], hit: np.ndarray, pending: np.ndarray) -> None:
        """Set ``pending`` (and ``hit``) for announced keys among the misses (a Python step per miss,
        only while some store is announced: the announcements are few, the misses short)."""
        if self.announced:
            ann = self.announced
            for i in np.flatnonzero(~hit).tolist():
                if keys[i] in ann:
                    pending[i] = hit[i] = True

    def disk_pin(self, slots: np.ndarray) -> None:
        if self.disk is not None:
            self.disk.pin(slots)

    def disk_unpin(self, slots: np.ndarray) -> None:
        if self.disk is not None:
            self.disk.unpin(slots)

    def event(self, kind: str, tier: str, rows: np.ndarray) -> None:
        if len(rows):
            # Every caller passes a fancy-indexed copy (or a view of one) that nothing mutates later.
            self._events.append((kind, tier, rows))
            if self._on_event is not None:
                self._on_event(kind, tier, len(rows))

    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        out = [(kind, tier, [bytes(r) for r in rows]) for kind, tier, rows in self._events]
        self._events.clear()
        return out
