"""The batch policy interface over the native core's policies (native/policy.hpp), one call per batch.

A standalone policy owns its lists and a tag per slot (the ghosts' identity, given by ``key_tag``
on insert); a tier's policy lives inside the tier's core instead (manager/tier_index.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ...core import core
from ...errors import SlotError
from ...policy import KINDS
from .base import EvictionPolicy, as_slots, check_evict_n, check_num_slots, check_pins

KeyTag = Callable[[np.ndarray], np.ndarray]


class NativePolicy(EvictionPolicy):
    """One of the core's policies; ``key_tag(slots) -> uint64 tags`` names the keys (slot ids without it)."""

    name: ClassVar[str]

    __slots__ = ("_n", "_core", "_key_tag")

    def __init__(self, num_slots: int, *, key_tag: KeyTag | None = None, start: float = 0.0, low: float = 0.0,
                 high: float = 0.0) -> None:  # fmt: skip
        self._n = check_num_slots(num_slots)
        self._core = core.PolicyCore(KINDS[self.name], self._n, secrets.randbits(64), start, low, high)
        self._key_tag = key_tag

    def _tags(self, slots: np.ndarray) -> np.ndarray:
        if self._key_tag is None or self.name == "lru":
            return slots
        tags = np.asarray(self._key_tag(slots))
        if tags.shape != slots.shape or tags.dtype.kind not in "iu":
            raise SlotError(f"key_tag returned {tags.dtype} {tags.shape} for {slots.size} slots")
        return tags

    def insert(self, slots: np.ndarray) -> None:
        s = as_slots(slots, self._n)
        self._core.insert(s, self._tags(s))

    def touch(self, slots: np.ndarray) -> None:
        self._core.touch(as_slots(slots, self._n))

    def remove(self, slots: np.ndarray) -> None:
        self._core.remove(as_slots(slots, self._n))

    def demote(self, slots: np.ndarray) -> None:
        self._core.demote(as_slots(slots, self._n))

    def evict(self, n: int, pins: np.ndarray) -> np.ndarray:
        n = check_evict_n(n)
        return self._core.evict(n, check_pins(pins, self._n))

    @property
    def num_slots(self) -> int:
        return self._n

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, slot: object) -> bool:
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool):
            return False
        return self._core.tracked(int(slot))

    def order(self) -> list[int]:
        return self._core.order()

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    def check_invariants(self) -> None:
        self._core.check_invariants()
