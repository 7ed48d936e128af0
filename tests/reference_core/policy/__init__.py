"""Eviction policies behind one batch interface (see base.EvictionPolicy); pick one by name."""

from __future__ import annotations

from tiered_kv.errors import ConfigError

from .arc import ARCPolicy, KeyTag
from .base import EvictionPolicy
from .lru import LRUPolicy
from .window import WindowPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy, WindowPolicy)}
POLICIES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, num_slots: int, *, key_tag: KeyTag | None = None) -> EvictionPolicy:
    """The policy called ``name`` ("lru", "arc" or "window", any case) for a tier of ``num_slots`` slots.

    ``key_tag(slots) -> uint64 array`` names the key each slot holds; ARC and
    the adaptive window keep those tags for their ghost lists (the slot id
    stands in without it). LRU needs none.
    """
    cls = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"eviction.policy: unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
    if issubclass(cls, ARCPolicy):  # the window policy too: both keep ghosts by key tag
        return cls(num_slots, key_tag=key_tag)
    return cls(num_slots)


__all__ = ["ARCPolicy", "EvictionPolicy", "KeyTag", "LRUPolicy", "POLICIES", "WindowPolicy", "make_policy"]
