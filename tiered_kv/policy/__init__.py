"""Eviction policies behind one interface (see base.EvictionPolicy); pick one by name."""

from __future__ import annotations

from ..errors import ConfigError
from .arc import ARCPolicy
from .base import EvictionPolicy
from .lru import LRUPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy)}
POLICIES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, num_slots: int) -> EvictionPolicy:
    """The policy called ``name`` ("lru" or "arc", any case) for a tier of ``num_slots`` slots."""
    cls = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"eviction.policy: unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
    return cls(num_slots)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "POLICIES", "make_policy"]
