"""Eviction policies as standalone objects behind one batch interface (see base.EvictionPolicy), native in the core.

The replay's flat simulators (replay/simulate.py) run them; the cache's tiers run the same policies
inside the core's tier index (manager/tier_index.py), by the names and constants in tiered_kv/policy.py.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...policy import POLICIES
from .arc import ARCPolicy, KeyTag
from .base import EvictionPolicy
from .lru import LRUPolicy
from .window import WindowPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy, WindowPolicy)}


def make_policy(name: str, num_slots: int, *, key_tag: KeyTag | None = None) -> EvictionPolicy:
    """The policy called ``name`` ("lru", "arc" or "window", any case) for a tier of ``num_slots`` slots.

    ``key_tag(slots) -> uint64 array`` names the key each slot holds; ARC and
    the adaptive window keep those tags for their ghost lists (the slot id
    stands in without it). LRU needs none.
    """
    cls = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"eviction.policy: unknown policy {name!r}; allowed: {', '.join(POLICIES)}")
    return cls(num_slots, key_tag=key_tag)


__all__ = ["ARCPolicy", "EvictionPolicy", "KeyTag", "LRUPolicy", "POLICIES", "WindowPolicy", "make_policy"]
