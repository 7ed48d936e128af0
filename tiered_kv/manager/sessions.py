"""Session hints from the frontend: which chains belong to live conversations.

A frontend often knows what a trace cannot: that a conversation goes on, or
that it has ended. ``register(session, rows)`` records a session's current
chain (the keys of its latest request; a later turn's chain extends it and
replaces it). ``release(session)`` forgets the session and returns the keys of
its chain that no other live session shares: the manager makes them the first
eviction candidates in every tier. A shared head (a system prompt) stays
where the policy put it as long as some live session still holds it.

A session registered with ``protect`` (the frontend expects a follow-up) has its
chain protected: its blocks outrank every block of no protected session, in every
tier (the manager holds them while an eviction picks; they go only when nothing
else can). Protection is bounded three ways, so hints never starve unhinted
traffic: at most ``max_protected`` keys (the oldest protected sessions lose it
first), a session idle for ``idle_s`` (no request registered it since) loses it,
and ``release`` ends it. A session that loses protection stays live.

Held per live session, bounded by ``max_sessions`` (the oldest are forgotten
without release when more arrive) and per key of a live chain by a reference
count; nothing here is per resident block.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np

EMPTY_ROWS = np.zeros((0, 0), dtype=np.uint8)


class Sessions:
    """Live sessions' chains and how many live sessions hold each key."""

    def __init__(self, key_bytes: int, max_sessions: int = 1 << 16, max_protected: int = 0, idle_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.key_bytes = key_bytes
        self.max_sessions = max_sessions
        self.max_protected = max_protected
        self.idle_s = idle_s
        self._clock = clock
        self._chains: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._refs: dict[bytes, int] = {}
        self._protected: OrderedDict[Hashable, float] = OrderedDict()  # session -> last registered, oldest first
        self._prot_refs: dict[bytes, int] = {}
        self._prot_rows: np.ndarray | None = None  # the protected keys as rows, rebuilt after a change

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, session: object) -> bool:
        return session in self._chains

    def register(self, session: Hashable, rows: np.ndarray, protect: bool = False) -> None:
        """``rows`` (``uint8[n, key_bytes]``) become the session's chain; the session becomes the newest."""
        old = self._chains.pop(session, None)
        self._unprotect(session, old)
        self._chains[session] = rows
        self._count(self._refs, rows, +1)
        if old is not None:
            self._count(self._refs, old, -1)
        if protect and self.max_protected > 0:
            self._protected[session] = self._clock()
            self._count(self._prot_refs, rows, +1)
            self._prot_rows = None
            while len(self._prot_refs) > self.max_protected and self._protected:
                oldest = next(iter(self._protected))
                self._unprotect(oldest, self._chains[oldest])
        while len(self._chains) > self.max_sessions:
            dropped_session, dropped = self._chains.popitem(last=False)
            self._unprotect(dropped_session, dropped)
            self._count(self._refs, dropped, -1)

    @property
    def n_protected(self) -> int:
        return len(self._prot_refs)

    def any_protected(self, rows: np.ndarray) -> bool:
        """Whether one of these key rows belongs to a protected chain (a dict lookup per row)."""
        refs = self._prot_refs
        return bool(refs) and any(bytes(r) in refs for r in rows)

    def protected_rows(self) -> np.ndarray:
        """``uint8[k, key_bytes]``: every protected key once, after idle sessions lost their protection."""
        if self._protected and self.idle_s is not None:
            expired = self._clock() - self.idle_s
            while self._protected:
                oldest, seen = next(iter(self._protected.items()))
                if seen > expired:
                    break
                self._unprotect(oldest, self._chains[oldest])
        if self._prot_rows is None:
            keys = b"".join(self._prot_refs)
            self._prot_rows = np.frombuffer(keys, dtype=np.uint8).reshape(len(self._prot_refs), self.key_bytes)
        return self._prot_rows

    def _unprotect(self, session: Hashable, rows: np.ndarray | None) -> None:
        if session in self._protected:
            del self._protected[session]
            self._count(self._prot_refs, rows, -1)
            self._prot_rows = None

    def release(self, session: Hashable) -> np.ndarray:
        """Forget the session; its chain's rows no live session holds any more (chain order)."""
        rows = self._chains.pop(session, None)
        if rows is None:
            return np.zeros((0, self.key_bytes), dtype=np.uint8)
        self._unprotect(session, rows)
        self._count(self._refs, rows, -1)
        refs = self._refs
        unshared = np.fromiter((bytes(r) not in refs for r in rows), dtype=bool, count=len(rows))
        return rows[unshared]

    @staticmethod
    def _count(refs: dict[bytes, int], rows: np.ndarray, delta: int) -> None:
        for key in {bytes(r) for r in rows}:  # a chain names a key once; a set guards against repeats
            n = refs.get(key, 0) + delta
            if n > 0:
                refs[key] = n
            else:
                refs.pop(key, None)
