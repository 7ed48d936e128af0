"""Disk tier benchmarks, side by side with the raw syscalls in the same run and the same directory.

``bench_disk``: spill (``DiskStore.write_many``) and promote (``DiskStore.read_many``) of batches of
CPU-slab rows, against the fastest correct batched syscall of the same bytes: ONE ``os.pwritev`` /
``os.preadv`` of the batch's rows at consecutive offsets of a plain file in the same directory. Steady
state: both files hold every slot before the first timed round, the slab pages are faulted in, and the
rounds cycle over two slot ranges with fresh keys, as a running cache recycles its slots. Raw and ours
alternate within every round (the side that goes first alternates too), and each round gives one ratio
from two samples taken moments apart; the report is the median of those ratios with quartiles and
extremes, plus each side's GB/s (payload bytes; ours also writes a 4 KiB header+padding per record).
Reads run warm (from the page cache) and, with ``cold``, after both files were fsynced and evicted
(posix_fadvise DONTNEED, plus /proc/sys/vm/drop_caches when writable): the device's speed then.
Beside the raw syscall made inline, every round also times the same syscall through a thread
(``run_in_executor``), the hand-off that any asyncio caller pays and that ours pays once per batch:
``vs_raw_in_thread`` is ours' ratio against that. ``cpu_ratio`` compares the process CPU time of raw
and ours (all threads): on a busy shared machine it says what the wall-clock ratios cannot.

``bench_recovery``: time of DiskStore.open() on a journal of N committed blocks (blocks/s).
Both are synchronous entry points (they run their own event loop) and return plain dicts.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from tiered_kv.loops import run as run_loop
from tiered_kv.tiers.disk import DiskStore
from tiered_kv.tiers.disk.format import (
    JINVALIDATE,
    JOURNAL_FILE,
    DiskNamespace,
    encode_journal,
    encode_records,
)

MIN_ROUNDS = 9


def _evict(paths: list[str]) -> str:
    """Push the files out of the page cache; return the method used."""
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


def _spread(xs: Sequence[float], digits: int) -> dict:
    xs = sorted(xs)
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    out = {k: round(v, digits) for k, v in (("median", med), ("q1", q1), ("q3", q3), ("lo", xs[0]), ("hi", xs[-1]))}
    return {**out, "n": len(xs)}


def _compare(raw_s: list[float], ours_s: list[float], nbytes: int) -> dict:
    """Paired samples -> ratio (ours' speed / raw's, per round) and each side's GB/s, medians and spread."""
    return {"ratio": _spread([r / o for r, o in zip(raw_s, ours_s, strict=True)], 3),
            "raw_gbps": _spread([nbytes / 1e9 / s for s in raw_s], 3),
            "ours_gbps": _spread([nbytes / 1e9 / s for s in ours_s], 3)}  # fmt: skip


class _Rig:
    """One block size: a source and a destination slab, a raw file and a DiskStore in the same directory."""

    def __init__(self, tmpdir: str, bs: int, n: int) -> None:
        self.bs, self.n = bs, n
        self.rng = np.random.default_rng(bs)
        self.src = self.rng.integers(0, 256, size=(n, bs), dtype=np.uint8)
        self.dst = np.ones_like(self.src)  # written, so its pages are faulted in
        self.rows = np.arange(n)
        self.src_iov = [memoryview(self.src[i]) for i in range(n)]  # the raw side gets its views for free
        self.dst_iov = [memoryview(self.dst[i]) for i in range(n)]
        self.raw_path = os.path.join(tmpdir, f"raw-{bs}.bin")
        self.fd = os.open(self.raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.store = DiskStore(os.path.join(tmpdir, "ours"), DiskNamespace("bench", "uint8", f"bench-{bs}", bs, 32),
                               2 * n)  # fmt: skip
        self.keys = [self._fresh_keys(), self._fresh_keys()]  # what each of the two slot ranges holds

    def _fresh_keys(self) -> np.ndarray:
        return self.rng.integers(0, 256, size=(self.n, 32), dtype=np.uint8)

    def files(self) -> list[str]:
        return [self.raw_path, *(os.path.join(self.store.path, f) for f in ("blocks.dat", JOURNAL_FILE))]

    def slots(self, k: int) -> np.ndarray:
        return np.arange(k * self.n, (k + 1) * self.n)

    async def _raw(self, syscall: Callable, iov: list, k: int, threaded: bool) -> tuple[float, int]:
        off = k * self.n * self.bs
        t = time.perf_counter()
        if threaded:  # the hand-off that any asyncio caller pays, as ours does once per batch
            got = await asyncio.get_running_loop().run_in_executor(None, syscall, self.fd, iov, off)
        else:
            got = syscall(self.fd, iov, off)
        return time.perf_counter() - t, got

    async def raw_write(self, k: int, threaded: bool = False) -> float:
        dt, got = await self._raw(os.pwritev, self.src_iov, k, threaded)
        if got != self.n * self.bs:
            raise RuntimeError(f"raw pwritev wrote {got} of {self.n * self.bs} bytes")
        return dt

    async def ours_write(self, k: int) -> float:
        self.keys[k] = keys = self._fresh_keys()  # recycled slots get new blocks, as in a running cache
        t = time.perf_counter()
        ok = await self.store.write_many(self.slots(k), keys, self.src, self.rows)
        dt = time.perf_counter() - t
        if not ok.all():
            raise RuntimeError(f"bench write failed for {int((~ok).sum())} blocks")
        return dt

    async def raw_read(self, k: int, threaded: bool = False) -> float:
        self.dst[:] = 0
        dt, got = await self._raw(os.preadv, self.dst_iov, k, threaded)
        if got != self.n * self.bs or not np.array_equal(self.dst, self.src):
            raise RuntimeError("raw read-back differs")  # the bench's own sanity check
        return dt

    async def ours_read(self, k: int) -> float:
        self.dst[:] = 0
        t = time.perf_counter()
        ok = await self.store.read_many(self.slots(k), self.keys[k], self.dst, self.rows)
        dt = time.perf_counter() - t
        if not ok.all() or not np.array_equal(self.dst, self.src):
            raise RuntimeError("DiskStore read-back differs")
        return dt

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.raw_path)
        shutil.rmtree(self.store.path, ignore_errors=True)


async def _round(r: int, sides: dict[str, Callable[[], Awaitable[float]]],
                 before: Callable[[], object] | None) -> dict[str, tuple[float, float]]:  # fmt: skip
    """One sample of each side, the order rotated by one each round (no side is always first):
    (wall seconds, process CPU seconds, all threads) per side."""
    names = list(sides)
    out = {}
    for name in names[r % len(names) :] + names[: r % len(names)]:
        if before is not None:
            before()
        cpu = time.process_time()
        wall = await sides[name]()
        out[name] = (wall, time.process_time() - cpu)
    return out


async def _bench_size(tmpdir: str, bs: int, n: int, rounds: int, cold: bool) -> dict:
    rig = _Rig(tmpdir, bs, n)
    await rig.store.open()
    kinds = ("write", "read_warm", "read_cold") if cold else ("write", "read_warm")
    samples: dict[str, dict[str, list[float]]] = {k: {"raw": [], "raw_thread": [], "ours": []} for k in kinds}
    cpu: dict[str, dict[str, list[float]]] = {k: {"raw": [], "ours": []} for k in kinds}
    method = ""

    def evict() -> None:
        nonlocal method
        method = _evict(rig.files())

    try:
        for k in (0, 1):  # steady state: every slot of both files written once, both read once
            await rig.raw_write(k)
            await rig.ours_write(k)
            await rig.raw_read(k)
            await rig.ours_read(k)
        syscalls0 = rig.store.write_syscalls
        for r in range(rounds):
            k = r % 2
            for name in kinds:
                raw, ours = (rig.raw_write, rig.ours_write) if name == "write" else (rig.raw_read, rig.ours_read)
                got = await _round(r, {"raw": lambda raw=raw, k=k: raw(k),
                                       "raw_thread": lambda raw=raw, k=k: raw(k, threaded=True),
                                       "ours": lambda ours=ours, k=k: ours(k)},
                                   evict if name == "read_cold" else None)  # fmt: skip
                for side, (secs, cpu_s) in got.items():
                    samples[name][side].append(secs)
                    if side in cpu[name]:
                        cpu[name][side].append(cpu_s)
        syscalls = (rig.store.write_syscalls - syscalls0) / rounds
    finally:
        await rig.store.aclose()
        rig.close()
    out = {"block_bytes": bs, "blocks_per_batch": n, "rounds": rounds, "pwritev_per_batch": syscalls}
    for name, s in samples.items():
        out[name] = _compare(s["raw"], s["ours"], n * bs)
        out[name]["vs_raw_in_thread"] = _compare(s["raw_thread"], s["ours"], n * bs)["ratio"]
        # CPU seconds raw / ours: what the checksums and the hand-off cost, however busy the machine is
        c = cpu[name]
        out[name]["cpu_ratio"] = round(statistics.median(c["raw"]) / max(statistics.median(c["ours"]), 1e-9), 3)
    if cold:
        out["cache_drop"] = method
    return out


def bench_disk(tmpdir: str, block_sizes: tuple[int, ...] = (256 * 1024, 2 * 1024 * 1024),
               blocks_per_size: int = 64, repeats: int = MIN_ROUNDS, cold: bool = True) -> dict:  # fmt: skip
    """Spill write / promote read through DiskStore vs raw pwritev/preadv; ratios ours/raw (target >= 0.8).

    ``repeats`` is the number of interleaved rounds (>= 9 for figures worth reporting).
    """
    async def run() -> list[dict]:
        return [await _bench_size(tmpdir, bs, blocks_per_size, repeats, cold) for bs in block_sizes]

    return {"method": "interleaved rounds, medians of per-round ratios (q1, q3, lo, hi)", "sizes": run_loop(run())}


async def _bench_recovery_one(tmpdir: str, count: int, history: bool) -> dict:
    ns = DiskNamespace("bench-recovery", "uint8", f"rec-{count}-{history}", 64, 32)
    root = os.path.join(tmpdir, "recovery")
    store = DiskStore(root, ns, count)
    await store.open()
    await store.aclose()
    # Build the journal directly (writing 1e5 real blocks first would dominate the bench): one commit per
    # slot, or with history: an older commit and its invalidate before each live commit.
    rng = np.random.default_rng(count)
    slots = np.arange(count, dtype=np.uint32)
    keys = rng.integers(0, 256, size=(count, 32), dtype=np.uint8)
    blob = encode_journal(32, slots, np.arange(1, count + 1, dtype=np.uint64), rng.integers(0, 2**63, count,
                          dtype=np.uint64).astype(np.uint64), keys)  # fmt: skip
    if history:
        old = encode_journal(32, slots, np.zeros(count, np.uint64), np.zeros(count, np.uint64), keys[::-1])
        blob = old + encode_records(JINVALIDATE, slots, 0) + blob[64:]
    with open(os.path.join(store.path, JOURNAL_FILE), "wb") as f:
        f.write(blob)
    t = time.perf_counter()
    store = DiskStore(root, ns, count)
    rec = await store.open()
    dt = time.perf_counter() - t
    await store.aclose()
    shutil.rmtree(store.path, ignore_errors=True)
    if len(rec) != count:
        raise RuntimeError(f"recovered {len(rec)} of {count}")
    return {"blocks": count, "journal_records": len(blob) // 64 - 1, "open_s": round(dt, 4),
            "blocks_per_s": round(count / dt)}  # fmt: skip


def bench_recovery(tmpdir: str, counts: tuple[int, ...] = (10_000, 100_000)) -> dict:
    """DiskStore.open() recovery speed in blocks/s (target >= 100k blocks/s)."""
    async def run() -> list[dict]:
        return [await _bench_recovery_one(tmpdir, c, h) for c in counts for h in (False, True)]

    return {"runs": run_loop(run())}


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as d:
        print(json.dumps({"disk": bench_disk(d), "recovery": bench_recovery(d)}, indent=1))
