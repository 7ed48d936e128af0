"""Shared by the DiskStore tests (test_disk_store*.py): the namespace, keys, payloads and one-block I/O."""

from __future__ import annotations

import hashlib

from disk_helpers import get1, put

from tiered_kv.tiers.disk import DiskNamespace, DiskStore

BPB = 4096 + 1000 + 3  # not a multiple of anything: records carry padding
NS = DiskNamespace("model-a", "float16", "layout-1", BPB, 32)


def key_of(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"{salt}{i}".encode()).digest()


def payload(key: bytes) -> bytes:
    return hashlib.shake_128(key).digest(BPB)


async def read_bytes(store: DiskStore, slot: int, key: bytes) -> bytes | None:
    return await get1(store, slot, key)


async def write(store: DiskStore, slot: int, key: bytes) -> None:
    assert (await put(store, [slot], [key])).all()

