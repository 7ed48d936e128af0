"""RemoteResidency: the keys this instance believes Redis holds, for the synchronous lookup.

It never touches the network. Keys enter after our own successful ``put`` or an ``exists`` probe,
and leave when a ``get`` finds them gone or corrupt, or when the filter is full (oldest first).
The staleness it allows, both ways a miss or a lost hit, never wrong bytes:

* a key another instance (or Redis's maxmemory policy, or its TTL) removed still reads as known
  until a ``get`` misses it; the load then falls back to recomputing that block;
* a key another instance wrote is unknown here until a probe (``exists``) or our own ``put`` adds it.

Storage is a KeyTable (the native core's key table, native/keytable.hpp: no Python object per key)
over a ring of ``max_keys`` slots: a new key takes the next ring slot, evicting the key that held it.
"""

from __future__ import annotations

import numpy as np

from ...core import core, seeds
from ...errors import KeyFormatError, TieredKVError


class KeyTable(core.KeyIndex):
    """Fixed-length bytes key -> slot id 0..num_slots-1, each slot holding at most one key.

    Open addressing with linear probing and backward-shift deletion over int32 entries, keyed hashes
    of every key byte (per-table secrets). Every call is one batch: keys as a sequence of ``bytes`` or
    a ``uint8[n, key_bytes]`` array, slots as a 1-D integer array. A refused batch (a key present
    twice, a slot already holding one) raises before anything changes.
    """

    def __init__(self, num_slots: int, key_bytes: int) -> None:
        for name, value, low in (("num_slots", num_slots, 1), ("key_bytes", key_bytes, 8)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise TieredKVError(f"KeyTable {name} must be an int >= {low}, got {value!r}")
        super().__init__(int(num_slots), int(key_bytes), seeds())
        self.slot_keys = self.keys_view()  # uint8[num_slots, key_bytes]; rows of empty slots are stale

    def key_of(self, slot: int) -> bytes:
        """The key a slot holds; TieredKVError if it holds none."""
        return self.keys_of(np.array([slot]))[0]


class RemoteResidency:
    def __init__(self, max_keys: int) -> None:
        if isinstance(max_keys, bool) or not isinstance(max_keys, (int, np.integer)) or not 1 <= max_keys < 2**31:
            raise TieredKVError(f"RemoteResidency max_keys must be an int in [1, 2^31), got {max_keys!r}")
        self.max_keys = int(max_keys)
        self._table: KeyTable | None = None  # made on the first add, when the key length is known
        self._next = 0  # ring position of the next key

    def __len__(self) -> int:
        return 0 if self._table is None else len(self._table)

    def _rows(self, keys: np.ndarray) -> np.ndarray:
        if not isinstance(keys, np.ndarray) or keys.dtype != np.uint8 or keys.ndim != 2:
            raise KeyFormatError(f"residency keys must be a uint8[n, key_bytes] array, got {getattr(keys, 'shape', keys)!r}")
        if self._table is not None and keys.shape[1] != self._table.key_bytes:
            raise KeyFormatError(f"residency keys have {keys.shape[1]} bytes, this filter holds {self._table.key_bytes}")
        return np.ascontiguousarray(keys)

    def known(self, keys: np.ndarray) -> np.ndarray:
        keys = self._rows(keys)
        if self._table is None or not len(keys):
            return np.zeros(len(keys), dtype=bool)
        return self._table.find(keys) >= 0

    def add(self, keys: np.ndarray) -> None:
        keys = self._rows(keys)
        if not len(keys):
            return
        if self._table is None:
            self._table = KeyTable(self.max_keys, keys.shape[1])
        _, first = np.unique(keys.view(f"V{keys.shape[1]}").ravel(), return_index=True)
        new = keys[np.sort(first)]
        new = new[self._table.find(new) < 0][-self.max_keys :]  # already known: keep their place
        if not len(new):
            return
        ring = (self._next + np.arange(len(new))) % self.max_keys
        self._table.remove(ring[self._table.has_key(ring)])  # the oldest keys make room
        self._table.insert(new, ring)
        self._next = int((self._next + len(new)) % self.max_keys)

    def discard(self, keys: np.ndarray) -> None:
        keys = self._rows(keys)
        if self._table is None or not len(keys):
            return
        slots = self._table.find(keys)
        self._table.remove(np.unique(slots[slots >= 0]))

    @property
    def nbytes(self) -> int:
        return 0 if self._table is None else self._table.nbytes
