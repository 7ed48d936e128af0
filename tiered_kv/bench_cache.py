"""Cache-level benchmarks: TieredKVCache store/load vs the raw copy, lookup vs a dict loop,
index memory per resident block, and lookup time as the index grows.

Every figure is a ratio against the raw operation measured in the same run,
because these machines are shared and noisy.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import statistics
import time
import tracemalloc
from collections.abc import Sequence

import torch

from .cache import TieredKVCache
from .index import TierIndex
from .layout import KVLayout

_WORKING_SET = 64 << 20
# The raw op runs torch's OpenMP team on this thread; its threads spin for a
# while after each op and would steal the 2 cores from the run that follows.
_SETTLE_S = 0.05


def _keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


async def _cache_round(block_bytes: int, batch: int, repeats: int, concurrency: int) -> dict:
    rows = max(repeats * batch, _WORKING_SET // block_bytes)
    gen = torch.Generator().manual_seed(1)
    gpu = torch.randint(0, 256, (rows, block_bytes), dtype=torch.uint8, generator=gen)
    layout = KVLayout.from_tensors({"kv": gpu}, rows)
    cpu_slots = repeats * batch  # room for every stored batch: the store path measured, not eviction
    cfg = {
        "model": {"bytes_per_block": block_bytes},
        "gpu": {"num_blocks": rows},
        "tiers": {"cpu": {"capacity": cpu_slots * block_bytes, "pin_memory": "off"}, "disk": {"enabled": False}},
        "transfer": {"engine": "host", "max_inflight_bytes": max(256 << 20, 2 * batch * block_bytes)},
    }
    keys = _keys(cpu_slots, f"b{block_bytes}-")
    # Disjoint random GPU blocks per batch, so concurrent batches never share one.
    perm = torch.randperm(rows, generator=gen).tolist()
    store_ids = [perm[i * batch : (i + 1) * batch] for i in range(repeats)]
    perm = torch.randperm(rows, generator=gen).tolist()
    load_ids = [perm[i * batch : (i + 1) * batch] for i in range(repeats)]
    sem = asyncio.Semaphore(concurrency)

    async def bounded(coro):
        async with sem:
            return await coro

    raw_dst = torch.empty((batch, block_bytes), dtype=torch.uint8)
    async with TieredKVCache(cfg, layout) as cache:
        slab = cache.slabs.regions[0]
        raw_src_idx = [torch.tensor(ids) for ids in store_ids]
        slab.fill_(1)  # fault the pages in first: neither side should pay first-touch

        t0 = time.perf_counter()
        for i in range(repeats):
            torch.index_select(gpu, 0, raw_src_idx[i], out=slab[i * batch : (i + 1) * batch])
        raw_store = time.perf_counter() - t0
        slab.zero_()
        await asyncio.sleep(_SETTLE_S)

        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(bounded(cache.store(keys[i * batch : (i + 1) * batch], store_ids[i])) for i in range(repeats))
        )
        ours_store = time.perf_counter() - t0
        if any(r.stored != batch for r in results):
            raise RuntimeError(f"bench store placed {[r.stored for r in results]} of {batch}")

        slot_idx = [torch.tensor([cache.cpu.ready[k] for k in keys[i * batch : (i + 1) * batch]]) for i in range(repeats)]
        t0 = time.perf_counter()
        for i in range(repeats):
            torch.index_select(slab, 0, slot_idx[i], out=raw_dst)
        raw_load = time.perf_counter() - t0
        await asyncio.sleep(_SETTLE_S)

        t0 = time.perf_counter()
        loaded = await asyncio.gather(
            *(bounded(cache.load(keys[i * batch : (i + 1) * batch], load_ids[i])) for i in range(repeats))
        )
        ours_load = time.perf_counter() - t0
        if loaded != [batch] * repeats:
            raise RuntimeError(f"bench load missed: {loaded}")
        # spot check: the last batch landed byte-exact
        if not torch.equal(gpu[load_ids[-1]], slab[slot_idx[-1]]):
            raise RuntimeError("bench load produced wrong bytes")
    nbytes = repeats * batch * block_bytes
    return {
        "block_bytes": block_bytes,
        "batch": batch,
        "concurrency": concurrency,
        "store_gbps": nbytes / ours_store / 1e9,
        "raw_store_gbps": nbytes / raw_store / 1e9,
        "store_ratio": raw_store / ours_store,
        "load_gbps": nbytes / ours_load / 1e9,
        "raw_load_gbps": nbytes / raw_load / 1e9,
        "load_ratio": raw_load / ours_load,
    }


def bench_cache(block_sizes: Sequence[int] = (16 << 10, 256 << 10, 2 << 20), batch: int = 64, repeats: int = 12,
                rounds: int = 3, concurrency: Sequence[int] = (1, 4)) -> list[dict]:
    """Store/load through TieredKVCache vs raw index_select(out=); medians of ``rounds``.

    concurrency 1 awaits each batch before the next (latency-bound: pays the
    worker hand-off every batch); 4 keeps four batches in flight, as a serving
    frontend with several requests does (throughput).
    """
    out = []
    for block_bytes in block_sizes:
        reps = max(4, min(repeats, (512 << 20) // (batch * block_bytes)))
        for conc in concurrency:
            runs = [asyncio.run(_cache_round(block_bytes, batch, reps, conc)) for _ in range(rounds)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row["block_bytes"], row["batch"], row["concurrency"] = block_bytes, batch, conc
            out.append(row)
    return out


def bench_lookup(prefix: int = 1000, rounds: int = 200) -> dict:
    """cache.lookup of a resident prefix vs a plain dict-membership loop over the same keys."""

    async def run() -> dict:
        gpu = torch.zeros((8, 16), dtype=torch.uint8)
        layout = KVLayout.from_tensors({"kv": gpu}, 8)
        cfg = {
            "model": {"bytes_per_block": 16},
            "gpu": {"num_blocks": 8},
            "tiers": {"cpu": {"capacity": 16 * prefix, "pin_memory": "off"}, "disk": {"enabled": False}},
        }
        keys = _keys(prefix, "lookup-")
        async with TieredKVCache(cfg, layout) as cache:
            for key in keys:  # make them resident without copies: bookkeeping only
                cache.cpu.commit(cache.cpu.reserve(key))
            plain = dict(cache.cpu.ready)

            def dict_loop() -> int:
                n = 0
                for key in keys:
                    if key not in plain:
                        break
                    n += 1
                return n

            raw = _best_of(dict_loop, rounds)
            ours = _best_of(lambda: cache.lookup(keys).total, rounds)
            if cache.lookup(keys).total != prefix:
                raise RuntimeError("bench lookup did not see the whole prefix")
        return {"prefix": prefix, "lookup_us": ours * 1e6, "dict_loop_us": raw * 1e6, "ratio": ours / raw}

    return asyncio.run(run())


def bench_index(sizes: Sequence[int] = (10_000, 100_000, 1_000_000), prefix: int = 1000) -> list[dict]:
    """Index memory per resident block (tracemalloc, keys included) and lookup time vs size."""
    rows = []
    for n in sizes:
        keys = _keys(n, f"idx{n}-")  # created before tracing: the caller owns its key objects...
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        index = TierIndex("cpu", n, "lru")
        for key in keys:
            index.commit(index.reserve(key))
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        key_bytes = sum(key.__sizeof__() for key in keys[:1000]) / 1000
        probe = keys[n // 2 : n // 2 + prefix]
        ready = index.ready

        def lookup(probe=probe, ready=ready) -> int:
            c = 0
            for key in probe:
                if key not in ready:
                    break
                c += 1
            return c

        t = _best_of(lookup, 50)
        rows.append({
            "resident_blocks": n,
            "index_bytes_per_block": used / n,
            "with_key_objects_bytes_per_block": used / n + key_bytes,  # ...which the index keeps alive
            "lookup_1000_us": t * 1e6,
        })  # fmt: skip
        del index, keys, probe, ready
        gc.collect()
    return rows


def _best_of(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
