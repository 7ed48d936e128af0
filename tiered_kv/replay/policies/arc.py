"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03) behind the batch interface (native/policy.hpp).

T1 holds blocks seen once, T2 blocks hit at least twice; the ghost lists B1/B2
remember tags of blocks recently evicted from T1/T2 (at most num_slots together).
A new block whose tag is a ghost was evicted too early: a B1 hit grows ``p`` (the
target size of T1, favouring recency), a B2 hit shrinks it, and the block goes
straight to T2. A scan of one-time keys therefore churns through T1 and leaves a
hot working set in T2.

The manager owns placement and decides when to evict, so this differs from the
paper's REPLACE in two ways: eviction is requested in batches (``evict(n)``) and
never knows the incoming key, and pinned slots are skipped rather than evicted.
A batch behaves exactly like its elements applied one by one in order; a tag
repeated within an insert batch is a ghost hit once. Memory: 9 bytes per slot
(shared lists) plus 25 bytes per ghost.
"""

from __future__ import annotations

from typing import ClassVar

from .native import KeyTag, NativePolicy

__all__ = ["ARCPolicy", "KeyTag"]


class ARCPolicy(NativePolicy):
    """ARC with the atomic batch-evict contract of EvictionPolicy.

    ``key_tag(slots)`` returns a uint64 tag per slot for the key the slot holds
    (read on insert); without it the slot id is the tag.
    """

    name: ClassVar[str] = "arc"
    __slots__ = ()

    @property
    def p(self) -> float:
        return self._core.p

    def ghost_sizes(self) -> tuple[int, int]:
        """(|B1|, |B2|)."""
        return self._core.ghost_sizes()

    def ghost_tags(self) -> tuple[list[int], list[int]]:
        """The tags in B1 and B2, oldest first (O(n); for tests and debugging)."""
        return self._core.ghost_tags()

    def list_sizes(self) -> tuple[int, int]:
        """(|T1|, |T2|)."""
        return self._core.list_sizes()

    @property
    def ghost_nbytes(self) -> int:
        return self._core.ghost_nbytes
