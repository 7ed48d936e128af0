"""The event loop's CPU per 64-block ``DiskStore.write_many`` batch, and O_DIRECT batches side by side.

    PYTHONPATH=. python scripts/disk_write_loop_cost.py [DIR]

1. 300 batches of 64 scattered slots (4 KiB blocks, buffered): the loop thread's ``time.thread_time`` per
   batch, median and p25 over the last 250 (what a write-through spill costs the loop besides its hand-off).
2. O_DIRECT (when DIR's file system takes it): 1 and 4 concurrent batches of 64 x 16 KiB, median wall
   time and MB/s (batches of other slots overlap their data writes).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time

import numpy as np

from tiered_kv.loops import run as run_loop
from tiered_kv.tiers.disk import DiskNamespace, DiskStore


async def loop_cost(root: str) -> None:
    store = DiskStore(root, DiskNamespace("m", "uint8", "x" * 16, 4096, 32), 4096)
    async with store:
        slab = np.random.default_rng(1).integers(0, 255, (256, 4096), dtype=np.uint8)
        rng, ts = np.random.default_rng(0), []
        for _ in range(300):
            slots, keys = rng.permutation(4096)[:64], rng.integers(0, 255, (64, 32), dtype=np.uint8)
            rows = rng.permutation(256)[:64]
            t0 = time.thread_time()
            await store.write_many(slots, keys, slab, rows)
            ts.append(time.thread_time() - t0)
    us = np.array(ts[50:]) * 1e6
    print(f"loop us per 64-block write_many: median {np.median(us):.0f}, p25 {np.percentile(us, 25):.0f}")


async def o_direct(root: str, conc: int) -> None:
    store = DiskStore(root, DiskNamespace("m", "uint8", "y" * 16, 16384, 32), 4096, o_direct=True)
    async with store:
        if not store.o_direct_active:
            print(f"O_DIRECT unusable: {store.o_direct_reason}")
            return
        slab = np.random.default_rng(1).integers(0, 255, (256, 16384), dtype=np.uint8)
        rng, ts = np.random.default_rng(0), []
        for _ in range(60):
            perm = rng.permutation(4096)
            batches = [store.write_many(perm[64 * j : 64 * (j + 1)], rng.integers(0, 255, (64, 32), dtype=np.uint8),
                                        slab, rng.permutation(256)[:64]) for j in range(conc)]  # fmt: skip
            t0 = time.perf_counter()
            await asyncio.gather(*batches)
            ts.append(time.perf_counter() - t0)
    s = float(np.median(ts[10:]))
    print(f"O_DIRECT, {conc} concurrent 64 x 16 KiB batches: median {s * 1e3:.1f} ms, {conc * 64 * 16384 / s / 1e6:.0f} MB/s")


def main() -> None:
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as d:
        run_loop(loop_cost(d + "/a"))
        for conc in (1, 4):
            run_loop(o_direct(d + f"/d{conc}", conc))


if __name__ == "__main__":
    main()
