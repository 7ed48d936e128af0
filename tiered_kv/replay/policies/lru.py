"""Least-recently-used eviction (native/policy.hpp: one linked list over the slots).

Prefix semantics: the manager inserts and touches a request's blocks
last-block-first (one batch in reverse prefix order), so the request's first
block ends most recent. LRU then evicts a prefix from its tail towards its
head, and what survives is always a usable leading prefix. Memory: 9 bytes per slot.
"""

from __future__ import annotations

from typing import ClassVar

from .native import NativePolicy


class LRUPolicy(NativePolicy):
    """Plain LRU: evicts the least recently inserted-or-touched unpinned slot first."""

    name: ClassVar[str] = "lru"
    __slots__ = ()
