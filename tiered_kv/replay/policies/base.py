"""The batch eviction-policy interface and the checks its implementations share.

A tier has ``num_slots`` integer slots. The index decides which slots hold
resident blocks; a policy only orders them for eviction. Every call takes a
batch: a 1-D int64 numpy array of slot ids (a list or a single int is
accepted and converted). A 1 TB tier of 16 KiB blocks holds ~64M blocks, so
the policies live in the native core (native/policy.hpp): fixed-size rows
per slot, no Python object per slot, one native call per batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from ...errors import SlotError

# Stamps and table values are int32 below this (2**31 blocks of 16 KiB = 32 TiB per tier).
MAX_SLOTS = 2**31 - 1
EMPTY = np.zeros(0, dtype=np.int64)


class EvictionPolicy(ABC):
    """Orders a tier's resident slots for eviction, a batch at a time.

    Synchronous and meant for the event-loop thread (no locks). Within a batch
    the order matters: the LAST element ends MOST recent, exactly as if the
    slots had been inserted or touched one by one in array order. A slot
    outside ``0..num_slots-1`` is a caller bug and raises ValueError; an
    in-range slot that is not tracked is ignored by touch and remove.
    """

    name: ClassVar[str]

    @abstractmethod
    def __init__(self, num_slots: int) -> None: ...

    @abstractmethod
    def insert(self, slots: np.ndarray) -> None:
        """Track newly resident slots; ValueError (and no change) if one is tracked or repeated."""

    @abstractmethod
    def touch(self, slots: np.ndarray) -> None:
        """Record hits; untracked slots are ignored."""

    @abstractmethod
    def remove(self, slots: np.ndarray) -> None:
        """Forget slots dropped without eviction (deleted, corrupt); untracked slots are ignored."""

    def demote(self, slots: np.ndarray) -> None:
        """Forget slots whose blocks moved up to a faster tier on a hit (the tier keeps them on its
        cold list). A policy with a history (the window's ghosts) may remember them; by default
        this is ``remove``."""
        self.remove(slots)

    @abstractmethod
    def evict(self, n: int, pins: np.ndarray) -> np.ndarray:
        """Remove and return exactly ``n`` tracked slots with ``pins[slot] == 0``, in eviction order.

        Atomic: when fewer than ``n`` such slots exist, returns an empty array
        and changes nothing (victims are selected before any mutation).
        """

    @property
    @abstractmethod
    def num_slots(self) -> int:
        """Slot ids run over ``0..num_slots-1``."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, slot: object) -> bool: ...

    @abstractmethod
    def order(self) -> list[int]:
        """Full eviction order, first = next victim (O(n); for tests and debugging)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the policy's arrays."""


def check_num_slots(num_slots: int) -> int:
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or not 0 <= num_slots <= MAX_SLOTS:
        raise SlotError(f"num_slots must be an int in 0..{MAX_SLOTS}, got {num_slots!r}")
    return num_slots


def check_evict_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise SlotError(f"evict(n): n must be an int, got {n!r}")
    if n < 0:
        raise SlotError(f"evict(n): n must be >= 0, got {n}")
    return int(n)


def as_slots(slots: object, num_slots: int) -> np.ndarray:
    """``slots`` as a 1-D int64 array, every id in ``0..num_slots-1`` (else ValueError)."""
    arr = np.asarray(slots)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    elif arr.ndim != 1:
        raise SlotError(f"slots must be a 1-D array, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size and arr.dtype.kind not in "iu":
            raise SlotError(f"slots must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    # One reduction catches both ends: a negative id is huge as uint64.
    if arr.size and np.maximum.reduce(arr.view(np.uint64)) >= num_slots:
        bad = int(arr[(arr < 0) | (arr >= num_slots)][0])
        raise SlotError(f"slot {bad} out of range for a policy of {num_slots} slots")
    return arr


def check_pins(pins: object, num_slots: int) -> np.ndarray:
    if not isinstance(pins, np.ndarray) or pins.shape != (num_slots,):
        shape = getattr(pins, "shape", type(pins).__name__)
        raise SlotError(f"pins must be an array of {num_slots} pin counts (one per slot), got {shape}")
    return pins
