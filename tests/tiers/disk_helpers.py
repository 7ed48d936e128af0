"""DiskStore test helpers: blocks whose bytes derive from their key, moved through the batch API.

No torch import: disk_writer_proc.py (a crash-test subprocess spawned two dozen times) uses these too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def payload(key: bytes, nbytes: int) -> bytes:
    return hashlib.shake_128(key).digest(nbytes)


def key_rows(keys: Sequence[bytes]) -> np.ndarray:
    """Keys as the ``uint8[n, key_bytes]`` array the batch API takes."""
    kb = len(keys[0]) if keys else 32
    return np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), kb).copy()


def slab_of(keys: Sequence[bytes], bpb: int) -> np.ndarray:
    """A CPU-slab-like array whose row i holds the payload of keys[i]."""
    return np.frombuffer(b"".join(payload(k, bpb) for k in keys), np.uint8).reshape(len(keys), bpb).copy()


async def put(store, slots: Sequence[int], keys: Sequence[bytes]) -> np.ndarray:
    """write_many of ``keys`` (payloads derived from them) at ``slots``; the ok mask."""
    bpb = store.namespace.bytes_per_block
    return await store.write_many(np.asarray(slots, np.int64), key_rows(keys), slab_of(keys, bpb),
                                  np.arange(len(keys)))


async def get(store, slots: Sequence[int], keys: Sequence[bytes]) -> list[bytes | None]:
    """read_many into a fresh slab (rows in reverse order, so row index != position); bytes or None each."""
    n, bpb = len(keys), store.namespace.bytes_per_block
    dst = np.zeros((n, bpb), np.uint8)
    rows = np.arange(n)[::-1].copy()
    ok = await store.read_many(np.asarray(slots, np.int64), key_rows(keys), dst, rows)
    return [dst[rows[i]].tobytes() if ok[i] else None for i in range(n)]


async def get1(store, slot: int, key: bytes) -> bytes | None:
    return (await get(store, [slot], [key]))[0]
