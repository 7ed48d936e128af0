"""The reference model's policies (numpy), by name, as tiered_kv.replay.policies.make_policy builds the native ones."""

from __future__ import annotations

from .arc import ARCPolicy, KeyTag
from .base import EvictionPolicy
from .lru import LRUPolicy
from .window import WindowPolicy

_BY_NAME = {cls.name: cls for cls in (LRUPolicy, ARCPolicy, WindowPolicy)}


def make_policy(name: str, num_slots: int, *, key_tag: KeyTag | None = None) -> EvictionPolicy:
    cls = _BY_NAME[name.lower()]
    return cls(num_slots, key_tag=key_tag) if cls is not LRUPolicy else cls(num_slots)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "WindowPolicy", "make_policy"]
