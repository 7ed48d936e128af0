"""Eviction policies behind one batch interface (see base.EvictionPolicy); pick one by name."""

from __future__ import annotations

from ..errors import ConfigError
from .arc import ARCPolicy, KeyTag
from .base import EvictionPolicy
from .lru import LRUPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy)}
POLICIES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, num_slots: int, *, key_tag: KeyTag | None = None) -> EvictionPolicy:
    """The policy called ``name`` ("lru" or "arc", any case) for a tier of ``num_slots`` slots.

    ``key_tag(slots) -> uint64 array`` names the key each slot holds; ARC keeps
    those tags for its ghost lists (the slot id stands in without it). LRU needs none.
    """
    cls = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"eviction.policy: unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
    if cls is ARCPolicy:
        return ARCPolicy(num_slots, key_tag=key_tag)
    return cls(num_slots)


__all__ = ["ARCPolicy", "EvictionPolicy", "KeyTag", "LRUPolicy", "POLICIES", "make_policy"]
