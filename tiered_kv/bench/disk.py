"""Disk spill and promote through TieredKVCache vs raw ``os.pwritev`` / ``os.preadv`` of the same bytes.

Ours is the cache's whole disk path: a ``store`` into a full CPU tier evicts
dirty blocks, which the spill runner writes (CPU slab rows -> DiskIO -> DiskStore) to
a full disk tier that recycles its slots; a ``load`` of a prefix that lives
only on disk promotes it (disk -> CPU slots) before the copy to the engine.
Its time is what the cache itself records for the ``cpu_to_disk`` /
``disk_to_cpu`` moves (``tiered_kv_transfer_seconds``: the handler's wall
time, budget waits excluded), so the store's engine copy and the load's are
not counted. Raw is one vectored syscall per batch, made inline: the batch's
run of slab rows to (from) consecutive offsets of a plain file as large as the
disk tier, in the same directory, cycled like the tier's slots.

Reads run warm (the page cache holds what was just written) and cold: before
every cold sample, of either side, all files are fsynced and dropped from the
page cache (posix_fadvise DONTNEED), so the device is read.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import numpy as np

from ..errors import TieredKVError
from ..loops import run as run_loop
from .rig import BATCH, engine_tensors, fresh_keys, open_cache, random_ids
from .stats import compare, interleave

BLOCK_SIZES = (256 << 10, 2 << 20)
REGIONS = 8
CPU_BATCHES, DISK_BATCHES = 2, 4  # tier sizes in batches: every timed store spills, every spill recycles


def bench_disk(directory: str, block_sizes=BLOCK_SIZES, *, rounds: int = 9, sample_bytes: int = 16 << 20) -> list[dict]:
    """Rows for spill (write), promote warm and promote cold per block size; synchronous."""
    rows: list[dict] = []
    for block_bytes in block_sizes:
        rows += run_loop(_case(directory, block_bytes, rounds, sample_bytes))
    return rows


def drop_page_cache(directory: str) -> None:
    """fsync every file under ``directory`` and ask the kernel to drop its cached pages."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def _case(directory: str, block_bytes: int, rounds: int, sample_bytes: int) -> list[dict]:
    calls = max(1, sample_bytes // (BATCH * block_bytes))
    nbytes = calls * BATCH * block_bytes
    num_blocks = 2 * BATCH
    gpu = engine_tensors(block_bytes, REGIONS, num_blocks, "cpu")
    rng = np.random.default_rng(block_bytes)
    path = os.path.join(directory, f"disk-{block_bytes}")
    os.makedirs(path)
    cache = open_cache(gpu, block_bytes, CPU_BATCHES * BATCH, "cpu", disk_dir=os.path.join(path, "tier"),
                       disk_slots=DISK_BATCHES * BATCH)  # fmt: skip
    raw_fd = os.open(os.path.join(path, "raw.bin"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        async with cache:
            rows = await _run(cache, raw_fd, path, gpu, rng, block_bytes, calls, rounds)
    finally:
        os.close(raw_fd)
    return [{"op": op, "block_bytes": block_bytes, "regions": REGIONS, "batch": BATCH,
             "blocks_per_sample": calls * BATCH, "raw_method": method, **compare(raw_s, ours_s, nbytes)}
            for op, method, raw_s, ours_s in rows]  # fmt: skip


async def _run(cache, raw_fd: int, path: str, gpu, rng, block_bytes: int, calls: int, rounds: int) -> list[tuple]:
    slab = cache.slabs.slab_np
    slab.fill(1)  # fault the slab in
    kb, num_blocks = cache.keyer.key_bytes, int(gpu[0].shape[0])
    batch_bytes = BATCH * block_bytes
    raw_runs = [0]

    def raw_io(syscall: Callable, i: int) -> float:
        """``calls`` syscalls of one batch each: slab rows <-> consecutive offsets of the raw file, cycled."""
        spans = []
        for _ in range(calls):
            raw_runs[0] += 1
            rows = (raw_runs[0] % CPU_BATCHES) * BATCH
            spans.append((memoryview(slab[rows : rows + BATCH]).cast("B"), (raw_runs[0] % DISK_BATCHES) * batch_bytes))
        t0 = time.perf_counter()
        for buf, offset in spans:
            if syscall(raw_fd, [buf], offset) != batch_bytes:
                raise TieredKVError(f"bench: a raw {syscall.__name__} moved a short count")
        return time.perf_counter() - t0

    stored: list[list[bytes]] = []

    async def store_fresh() -> None:
        keys = fresh_keys(rng, BATCH, kb)
        res = await cache.store(keys, random_ids(rng, num_blocks).tolist())
        if res.stored != BATCH:
            raise TieredKVError(f"bench: a store of {BATCH} fresh keys placed {res.stored}")
        stored.append(keys)

    for _ in range(CPU_BATCHES + DISK_BATCHES + 1):  # both tiers full: from here every store spills and recycles
        await store_fresh()
    for k in range(DISK_BATCHES):  # the raw file written whole too: no timed write fills a hole
        os.pwritev(raw_fd, [memoryview(slab[:BATCH]).cast("B")], k * batch_bytes)

    async def ours_spill(_i: int) -> float:
        before = _moved(cache, "cpu_to_disk")
        for _ in range(calls):
            await store_fresh()
        return _took(cache, "cpu_to_disk", before, calls * batch_bytes)

    async def raw_write(i: int) -> float:
        return raw_io(os.pwritev, i)

    out = []
    raw_s, ours_s = await interleave({"pwritev": raw_write}, ours_spill, rounds)
    out.append(("spill", "os.pwritev, 1 per batch", raw_s["pwritev"], ours_s))

    def on_disk_only() -> list[bytes]:
        for keys in reversed(stored):
            if all(t == "disk" for t in cache.tiers_of(keys)):
                return keys
        raise TieredKVError("bench: no batch lives on disk only")

    for cold in (False, True):
        def settle(cold: bool = cold) -> None:
            if cold:
                drop_page_cache(path)

        async def ours_promote(_i: int) -> float:
            total = 0.0
            for _ in range(calls):
                keys = on_disk_only()
                await asyncio.to_thread(settle)
                before = _moved(cache, "disk_to_cpu")
                got = await cache.load(keys, random_ids(rng, num_blocks).tolist())
                if got != BATCH:
                    raise TieredKVError(f"bench: a load of a disk-resident batch returned {got} of {BATCH}")
                total += _took(cache, "disk_to_cpu", before, batch_bytes)
            return total

        async def raw_read(i: int) -> float:
            await asyncio.to_thread(settle)
            return raw_io(os.preadv, i)

        raw_s, ours_s = await interleave({"preadv": raw_read}, ours_promote, rounds)
        out.append(("promote " + ("cold" if cold else "warm"), "os.preadv, 1 per batch", raw_s["preadv"], ours_s))
    return out


def _moved(cache, direction: str) -> tuple[float, float]:
    """(seconds, bytes) the cache has recorded for ``direction`` so far."""
    metrics = cache.stats()["metrics"]
    try:
        return (metrics[f"tiered_kv_transfer_seconds_total{{{direction}}}"],
                metrics[f"tiered_kv_bytes_total{{{direction}}}"])  # fmt: skip
    except KeyError as exc:
        raise TieredKVError(f"bench: the cache's metrics have no {exc.args[0]}") from None


def _took(cache, direction: str, before: tuple[float, float], nbytes: int) -> float:
    seconds, moved = _moved(cache, direction)
    if moved - before[1] != nbytes:
        raise TieredKVError(f"bench: expected {nbytes} bytes {direction}, the cache moved {moved - before[1]:.0f}")
    return seconds - before[0]


def bench_disk_store(directory: str, *, quick: bool) -> dict:
    """The DiskStore alone (no cache, no runners) vs the same syscalls, and restart recovery: the disk tier's
    own bench, run here so one `tiered-kv bench` shows where the cache-level figures lose their time."""
    from .disk_store import bench_disk as store_bench
    from .disk_store import bench_recovery

    if quick:
        store = store_bench(directory, block_sizes=(64 << 10,), blocks_per_size=16, cold=False)
        recovery = bench_recovery(directory, counts=(10_000,))
    else:
        store, recovery = store_bench(directory), bench_recovery(directory)
    rows = []
    for size in store["sizes"]:
        for kind, fig in size.items():
            if isinstance(fig, dict) and "ratio" in fig:
                rows.append({"op": kind.replace("_", " "), "block_bytes": size["block_bytes"], "regions": 1,
                             "batch": size.get("blocks_per_batch"), "rounds": size.get("rounds", fig["ratio"].get("n")),
                             "raw_method": f"os.{'pwritev' if kind == 'write' else 'preadv'}, 1 per batch",
                             **fig})  # fmt: skip
    return {"rows": rows, "recovery": recovery.get("runs", recovery)}
