"""Disk tier benchmarks, side by side with the raw syscalls in the same run and the same directory.

``bench_disk``: DiskStore.write / read (asyncio, 4 in flight, as the spiller drives it) against a plain
loop of ``os.pwritev`` / ``os.preadv`` of the same bytes from/into the same rows. ``write_*`` passes land
in the page cache (memcpy speed: the harshest case for per-block overhead); ``durable_write_*`` passes end
with fdatasync (what sustained spilling costs). Before every read pass all files are fsynced and evicted
(posix_fadvise DONTNEED, plus /proc/sys/vm/drop_caches when writable), so reads come from the device.
Each figure is the best of ``repeats`` passes; raw and ours alternate within a repeat.

``bench_recovery``: time of DiskStore.open() on a journal of N committed blocks (blocks/s).
Both are synchronous entry points (they run their own event loop).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import time
from typing import Any

import numpy as np

from tiered_kv.tiers.disk_format import JINVALIDATE, JOURNAL_FILE, DiskNamespace, encode_journal, jrecord
from tiered_kv.tiers.disk_store import DiskStore

CONCURRENCY = 4


def _evict(paths: list[str]) -> str:
    """Push both files out of the page cache; return the method used."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise"


def _fdatasync(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


async def _drive(n: int, op: Any) -> None:
    """Run op(i) for i in range(n) with CONCURRENCY in flight, in index order."""
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await op(i)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def _bench_size(tmpdir: str, bs: int, n: int, repeats: int) -> dict:
    half = bs // 2
    rng = np.random.default_rng(bs)
    src = rng.integers(0, 256, size=(n, bs), dtype=np.uint8)  # one row per block, like a CPU slab
    dst = np.zeros_like(src)
    src_parts = [[src[i, :half], src[i, half:]] for i in range(n)]
    dst_parts = [[dst[i, :half], dst[i, half:]] for i in range(n)]
    keys = [hashlib.sha256(f"{bs}:{i}".encode()).digest() for i in range(n)]
    ns = DiskNamespace("bench", "uint8", f"bench-{bs}", bs, 32)
    raw_path = os.path.join(tmpdir, f"raw-{bs}.bin")
    best = dict.fromkeys(("write_raw", "write_ours", "read_raw", "read_ours", "durable_write_raw",
                          "durable_write_ours"), float("inf"))
    method, verified, ok = "", 0, []
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    store = DiskStore(os.path.join(tmpdir, "ours"), ns, n, [half, bs - half])
    await store.open()
    ours_files = [os.path.join(store.path, f) for f in ("blocks.dat", JOURNAL_FILE)]

    async def w(i: int) -> None:
        await store.write(i, keys[i], src_parts[i])

    async def r(i: int) -> None:
        ok.append(await store.read(i, keys[i], dst_parts[i]))

    def timed(name: str, t: float) -> None:
        best[name] = min(best[name], time.perf_counter() - t)

    try:
        for _ in range(repeats):
            for durable in (False, True):
                prefix = "durable_" if durable else ""
                t = time.perf_counter()
                for i in range(n):
                    os.pwritev(fd, src_parts[i], i * bs)
                if durable:
                    os.fdatasync(fd)
                timed(prefix + "write_raw", t)
                t = time.perf_counter()
                await _drive(n, w)
                if durable:
                    _fdatasync(ours_files)
                timed(prefix + "write_ours", t)
            method = _evict([raw_path, *ours_files])
            t = time.perf_counter()
            for i in range(n):
                os.preadv(fd, dst_parts[i], i * bs)
            timed("read_raw", t)
            if not np.array_equal(src, dst):
                raise RuntimeError("raw read-back differs")  # the bench's own sanity check
            dst[:] = 0
            ok.clear()
            method = _evict([raw_path, *ours_files])
            t = time.perf_counter()
            await _drive(n, r)
            timed("read_ours", t)
            verified = sum(ok) if np.array_equal(src, dst) else 0
            dst[:] = 0
    finally:
        os.close(fd)
        await store.aclose()
        os.unlink(raw_path)
        shutil.rmtree(store.path, ignore_errors=True)
    gbps = {k: n * bs / v / 1e9 for k, v in best.items()}
    return {"block_bytes": bs, "blocks": n, "verified": verified, "cache_drop": method,
            **{f"{k}_gbps": round(v, 3) for k, v in gbps.items()},
            "write_ratio": round(gbps["write_ours"] / gbps["write_raw"], 3),
            "read_ratio": round(gbps["read_ours"] / gbps["read_raw"], 3),
            "durable_write_ratio": round(gbps["durable_write_ours"] / gbps["durable_write_raw"], 3)}


def bench_disk(tmpdir: str, block_sizes: tuple[int, ...] = (256 * 1024, 2 * 1024 * 1024),
               blocks_per_size: int = 64, repeats: int = 3) -> dict:
    """DiskStore write/read throughput vs raw pwritev/preadv; ratios ours/raw (target >= 0.8)."""
    async def run() -> list[dict]:
        return [await _bench_size(tmpdir, bs, blocks_per_size, repeats) for bs in block_sizes]

    rows = asyncio.run(run())
    return {"concurrency": CONCURRENCY, "repeats": repeats, "fsync": False, "sizes": rows}


async def _bench_recovery_one(tmpdir: str, count: int, history: bool) -> dict:
    ns = DiskNamespace("bench-recovery", "uint8", f"rec-{count}-{history}", 64, 32)
    root = os.path.join(tmpdir, "recovery")
    store = DiskStore(root, ns, count, [64])
    await store.open()
    await store.aclose()
    # Build the journal directly (writing 1e5 real blocks first would dominate the bench): one commit per
    # slot, or with history: an older commit and its invalidate before each live commit.
    rng = np.random.default_rng(count)
    slots = np.arange(count, dtype=np.uint32)
    keys = rng.integers(0, 256, size=(count, 32), dtype=np.uint8)
    blob = encode_journal(32, slots, np.arange(1, count + 1, dtype=np.uint64), rng.integers(0, 2**63, count,
                          dtype=np.uint64).astype(np.uint64), keys)
    if history:
        old = encode_journal(32, slots, np.zeros(count, np.uint64), np.zeros(count, np.uint64), keys[::-1])
        inval = b"".join(jrecord(JINVALIDATE, s, 0) for s in range(count))
        blob = old + inval + blob[64:]
    with open(os.path.join(store.path, JOURNAL_FILE), "wb") as f:
        f.write(blob)
    t = time.perf_counter()
    store = DiskStore(root, ns, count, [64])
    rec = await store.open()
    dt = time.perf_counter() - t
    await store.aclose()
    shutil.rmtree(store.path, ignore_errors=True)
    if len(rec) != count:
        raise RuntimeError(f"recovered {len(rec)} of {count}")
    return {"blocks": count, "journal_records": len(blob) // 64 - 1, "open_s": round(dt, 4),
            "blocks_per_s": round(count / dt)}


def bench_recovery(tmpdir: str, counts: tuple[int, ...] = (10_000, 100_000)) -> dict:
    """DiskStore.open() recovery speed in blocks/s (target >= 100k blocks/s)."""
    async def run() -> list[dict]:
        return [await _bench_recovery_one(tmpdir, c, h) for c in counts for h in (False, True)]

    return {"runs": asyncio.run(run())}


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as d:
        print(json.dumps({"disk": bench_disk(d), "recovery": bench_recovery(d)}, indent=1))
