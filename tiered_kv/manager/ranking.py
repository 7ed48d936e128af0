"""Hints that rank: blocks of live sessions expecting a follow-up outrank every other block.

While an eviction picks its victims, the protected blocks of every tier are held (pinned), so the
policy takes from everything else first, in its own order. Only room for protected blocks (a
protected session's next blocks, a hit being served) may then take protected ones, in the policy's
order too; a one-off store that finds no unprotected room stores what fits and skips the rest. Pins, not reinsertion: the policy's lists,
ghosts and adaptation see exactly what they would without hints, so a hint changes which block
leaves, never a block's history. Costs one find and a pin per protected block per eviction that
happens while any session is protected; nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from .sessions import Sessions
from .tier_index import EMPTY, TierIndex


@contextmanager
def protected_held(sessions: Sessions, tiers: tuple[TierIndex | None, ...]) -> Iterator[None]:
    """Pin the READY blocks of protected keys in ``tiers`` for the duration (none when nothing is protected)."""
    rows = sessions.protected_rows() if sessions.n_protected else None
    held: list[tuple[TierIndex, np.ndarray]] = []
    try:
        if rows is not None and len(rows):
            for tier in tiers:
                if tier is not None:
                    slots = tier.find_ready(rows)
                    slots = slots[slots >= 0]
                    if len(slots):
                        tier.pin(slots)
                        held.append((tier, slots))
        yield
    finally:
        for tier, slots in held:
            tier.unpin(slots)


def ranked(sessions: Sessions, tiers: tuple[TierIndex | None, ...], n: int, take: Callable[[int, int], tuple],
           for_protected: bool) -> list[tuple]:  # fmt: skip
    """``take(n, 0)`` with protected blocks held; then, only when the room is for protected blocks
    themselves (``for_protected``: a protected session's store, a hit being served), ``take(rest, got)``
    with them released. Room for anything else never displaces a protected block: what does not fit
    is not stored. ``got``: the first call's victims, still READY and unpinned in no list until the
    caller reassigns or drops them, so the tier's ``evictable`` still counts them and the second call
    must ask for at most ``evictable - got`` (else the core's evict refuses). Returns the one or two
    results (the caller merges them)."""
    if not sessions.n_protected:
        return [take(n, 0)]
    with protected_held(sessions, tiers):
        first = take(n, 0)
    got = len(first[0])
    if got >= n or not for_protected:
        return [first]
    return [first, take(n - got, got)]


def merge_victims(parts: list[np.ndarray], cold: list[int]) -> tuple[np.ndarray, int]:
    """Victim arrays whose leading ``cold[i]`` came from a cold list -> one array, every cold one first."""
    if len(parts) == 1:
        return parts[0], cold[0]
    heads = [p[:c] for p, c in zip(parts, cold, strict=True)]
    tails = [p[c:] for p, c in zip(parts, cold, strict=True)]
    return np.concatenate(heads + tails) if parts else EMPTY, sum(cold)
