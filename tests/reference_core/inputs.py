"""Checking what callers hand the KeyTable: key buffers and slot arrays, with errors that name the culprit."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tiered_kv.errors import KeyFormatError, TieredKVError

KeysIn = Iterable[bytes] | np.ndarray


def key_buffer(keys: KeysIn, kb: int, each: bool = True) -> tuple[bytes, int]:
    """Keys as one buffer of n * key_bytes bytes; with ``each``, every key's own length is checked."""
    if isinstance(keys, np.ndarray):
        if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != kb:
            raise KeyFormatError(f"key array must be uint8[n, {kb}], got {keys.dtype}{list(keys.shape)}")
        return keys.tobytes(), keys.shape[0]
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise KeyFormatError(f"keys must be a sequence of {kb}-byte keys, got one {type(keys).__name__}")
    if not hasattr(keys, "__len__"):
        keys = list(keys)
    n = len(keys)
    try:
        joined = b"".join(keys)
    except TypeError:
        i, k = next((i, k) for i, k in enumerate(keys) if not isinstance(k, (bytes, bytearray)))
        raise KeyFormatError(f"keys[{i}] must be bytes, got {type(k).__name__}") from None
    # One C-level pass: len() of each key must be key_bytes (a total alone misses 33 + 31 bytes).
    if len(joined) != n * kb or (each and list(map(len, keys)).count(kb) != n):
        i, k = next(((i, k) for i, k in enumerate(keys) if len(k) != kb), (None, b""))
        what = f"keys[{i}] has {len(k)} bytes" if i is not None else f"{n} keys hold {len(joined)} bytes"
        raise KeyFormatError(f"{what}, expected {kb} per key")
    return joined, n

def slot_array(slots: np.ndarray, num_slots: int, op: str) -> np.ndarray:
    a = np.asarray(slots)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TieredKVError(f"{op}: slots must be a 1-D integer array, got {a.dtype}{list(a.shape)}")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= num_slots):
        bad = a[(a < 0) | (a >= num_slots)][0]
        raise TieredKVError(f"{op}: slot {int(bad)} is outside [0, {num_slots})")
    return a

def check_distinct_slots(slots: np.ndarray, op: str) -> None:
    s = np.sort(slots)
    rep = s[1:] == s[:-1]
    if rep.any():
        raise TieredKVError(f"{op}: slot {int(s[1:][rep][0])} appears twice in one batch")
