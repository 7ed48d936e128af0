"""Subprocess for test_disk_crash.py: opens a DiskStore and writes blocks until it is SIGKILLed.

usage: disk_writer_proc.py ROOT SEED NUM_SLOTS

Block contents derive from the key alone (``payload``), and a key's slot from the key and NUM_SLOTS
(``slot_of``), so the checker can verify any recovered block without talking to this process. Four
concurrent writers (like the spiller), each writing batches of 1-12 blocks (write_many: runs of adjacent
slots, one journal append per batch), overwriting slots, with an occasional invalidate_many(); a tiny
compaction slack makes journal compactions (temp file + os.replace) frequent enough to be killed mid-way.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
import time
import types
from pathlib import Path

# `import tiered_kv` runs its __init__, which pulls in torch (1-3 s here) via tiered_kv.layout; the store
# needs none of it and the crash test spawns two dozen writers, so register the bare package instead.
if "tiered_kv" not in sys.modules:
    _pkg = types.ModuleType("tiered_kv")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "tiered_kv")]
    sys.modules["tiered_kv"] = _pkg

import numpy as np  # noqa: E402
from disk_helpers import key_rows, slab_of  # noqa: E402

from tiered_kv.tiers.disk import DiskNamespace, DiskStore  # noqa: E402

BPB = 4096 + 1000 + 3
NS = DiskNamespace("crash-model", "float16", "crash-layout", BPB, 32)


def key_of(seed: int, i: int) -> bytes:
    return hashlib.sha256(f"{seed}:{i}".encode()).digest()


def slot_of(key: bytes, num_slots: int) -> int:
    return int.from_bytes(key[:4], "little") % num_slots


def payload(key: bytes) -> bytes:
    return hashlib.shake_128(key).digest(BPB)


async def main(root: str, seed: int, num_slots: int) -> None:
    store = DiskStore(root, NS, num_slots)
    store.compact_slack = 8
    await store.open()
    print("ready", flush=True)
    rng = random.Random(seed)
    busy = np.zeros(num_slots, bool)
    counter = iter(range(10**9))
    deadline = time.monotonic() + 30  # a safety net; the test kills us long before

    async def worker() -> None:
        while time.monotonic() < deadline:
            keys, slots = [], []
            for _ in range(rng.randint(1, 12)):
                key = key_of(seed, next(counter))
                slot = slot_of(key, num_slots)
                if not busy[slot] and slot not in slots:  # the cache never writes one slot twice at once
                    keys.append(key)
                    slots.append(slot)
            if not keys:
                await asyncio.sleep(0)
                continue
            busy[slots] = True
            try:
                ok = await store.write_many(np.array(slots), key_rows(keys), slab_of(keys, BPB), np.arange(len(keys)))
                assert ok.all()
            finally:
                busy[slots] = False
            if rng.random() < 0.05:
                victims = np.array([v for v in rng.sample(range(num_slots), 3) if not busy[v]], np.int64)
                store.invalidate_many(victims)

    await asyncio.gather(*(worker() for _ in range(4)))
    await store.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
