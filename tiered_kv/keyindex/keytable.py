"""KeyTable: fixed-length bytes key -> slot id, held by the native core (native/keytable.hpp).

Open addressing with linear probing and backward-shift deletion over int32 entries, keyed hashes
of every key byte (per-table secrets), no Python object per key. Every call is one batch: keys as a
sequence of ``bytes`` or a ``uint8[n, key_bytes]`` array, slots as a 1-D integer array. A refused
batch (a key present twice, a slot already holding one) raises before anything changes.
"""

from __future__ import annotations

import numpy as np

from ..core import core, seeds
from ..errors import TieredKVError


class KeyTable(core.KeyIndex):
    """Map fixed-length bytes keys to slot ids 0..num_slots-1; each slot holds at most one key."""

    def __init__(self, num_slots: int, key_bytes: int) -> None:
        for name, value, low in (("num_slots", num_slots, 1), ("key_bytes", key_bytes, 8)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise TieredKVError(f"KeyTable {name} must be an int >= {low}, got {value!r}")
        super().__init__(int(num_slots), int(key_bytes), seeds())
        self.slot_keys = self.keys_view()  # uint8[num_slots, key_bytes]; rows of empty slots are stale

    def key_of(self, slot: int) -> bytes:
        """The key a slot holds; TieredKVError if it holds none."""
        return self.keys_of(np.array([slot]))[0]
