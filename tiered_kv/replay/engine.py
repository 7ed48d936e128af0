"""The engine emulator: a GPU prefix cache over real KV tensors, driving a real TieredKVCache.

Per request: take the leading GPU hits, ask the cache for the rest, load them,
check every loaded byte against what its key must hold, "compute" the misses by
writing key-derived bytes, store them, then publish the blocks in the GPU prefix
cache (last block first, so a request's head is the most recent).

The GPU prefix cache is an LRU over GPU block ids with reference counts: a block
used by a running request is out of the LRU and cannot be evicted. A request is
admitted only when all its blocks fit at once (FIFO), so a waiting request holds
nothing and admission cannot deadlock; a request longer than the whole GPU is cut
to ``num_blocks`` blocks and the rest counted as ``truncated`` misses.

Byte generation and checking run on one worker thread (the emulator's "compute
stream"): torch releases the GIL there and the event loop keeps serving copies.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..cache import TieredKVCache
from .trace import Request

SEED_BYTES = 64  # per-key pattern, tiled over a region row: cheap to make and to compare


# -- expected bytes ---------------------------------------------------------------------
def key_patterns(keys: Sequence[bytes]) -> torch.Tensor:
    """``[len(keys), SEED_BYTES]`` uint8: the bytes each key's block repeats."""
    raw = b"".join(hashlib.blake2b(k, digest_size=SEED_BYTES).digest() for k in keys)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(keys), SEED_BYTES)


def region_rows(seeds: torch.Tensor, region: int, row_bytes: int) -> torch.Tensor:
    """Expected rows of one region: the seed shifted by the region index (a swap shows), tiled."""
    reps = -(-row_bytes // SEED_BYTES)
    return (seeds + region).repeat(1, reps)[:, :row_bytes]


# -- the GPU prefix cache -----------------------------------------------------------------
class GpuPrefixCache:
    """LRU over GPU block ids keyed by block key; referenced blocks are never evicted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cached: dict[bytes, int] = {}  # key -> gid, referenced or not
        self.gid_key: list[bytes | None] = [None] * num_blocks
        self.refs = [0] * num_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached gids, oldest first
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    def leading_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.cached:
                break
            n += 1
        return n

    def try_acquire(self, keys: Sequence[bytes]) -> tuple[int, list[int]] | None:
        """Pin the leading hits and allocate blocks for the rest, or change nothing (None)."""
        hits = self.leading_hits(keys)
        hit_ids = [self.cached[k] for k in keys[:hits]]
        need = len(keys) - hits
        idle_hits = sum(1 for g in hit_ids if self.refs[g] == 0)
        if need > len(self.free) + len(self.lru) - idle_hits:
            return None
        for gid in hit_ids:
            self._ref(gid)
        new_ids = [self._allocate() for _ in range(need)]
        for gid in new_ids:
            self.refs[gid] = 1
        return hits, hit_ids + new_ids

    def _ref(self, gid: int) -> None:
        if self.refs[gid] == 0:
            del self.lru[gid]
        self.refs[gid] += 1

    def _allocate(self) -> int:
        if self.free:
            return self.free.pop()
        gid, _ = self.lru.popitem(last=False)
        del self.cached[self.gid_key[gid]]  # type: ignore[arg-type]
        self.gid_key[gid] = None
        return gid

    def finish(self, keys: Sequence[bytes], gids: Sequence[int], publish: bool) -> None:
        """Drop the request's references, last block first, publishing its blocks if ``publish``."""
        for key, gid in zip(reversed(keys), reversed(gids), strict=True):
            owner = self.cached.get(key)
            if owner == gid:
                self.refs[gid] -= 1
                if self.refs[gid] == 0:
                    self.lru[gid] = None
            elif owner is not None or not publish:
                # A concurrent request published this key first (or we failed): give ours back.
                self.refs[gid] = 0
                self.free.append(gid)
                if owner is not None and owner in self.lru:
                    self.lru.move_to_end(owner)
            else:
                self.cached[key] = gid
                self.gid_key[gid] = key
                self.refs[gid] = 0
                self.lru[gid] = None


# -- stats --------------------------------------------------------------------------------
@dataclass
class EngineStats:
    requests: int = 0
    block_refs: int = 0
    hits_gpu: int = 0
    hits_cpu: int = 0
    hits_disk: int = 0
    computed: int = 0
    truncated: int = 0  # blocks past num_blocks of a request longer than the GPU
    stored: int = 0
    deduped: int = 0
    store_in_flight: int = 0
    store_skipped: int = 0
    lookup_in_flight: int = 0  # lookups that stopped at a block still being stored
    verified: int = 0
    corrupt: int = 0
    load_latency: list[float] = field(default_factory=list)
    store_latency: list[float] = field(default_factory=list)


# -- the emulator -------------------------------------------------------------------------
class EngineEmulator:
    """Runs requests against ``cache``; ``regions`` are the KV tensors the cache's layout binds."""

    def __init__(self, cache: TieredKVCache, regions: Sequence[torch.Tensor]) -> None:
        self.cache = cache
        self.regions = list(regions)
        self.device = self.regions[0].device
        self.gpu = GpuPrefixCache(self.regions[0].shape[0])
        self.stats = EngineStats()
        self._admission = asyncio.Lock()  # FIFO: a long request is not starved by short ones
        self._freed = asyncio.Event()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-kv-replay-compute")

    def close(self) -> None:
        self._compute.shutdown(wait=True)

    async def _on_compute(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    # -- bytes ----------------------------------------------------------------------------
    def _write(self, keys: Sequence[bytes], gids: Sequence[int]) -> None:
        seeds = key_patterns(keys)
        idx = torch.tensor(gids, dtype=torch.long, device=self.device)
        for r, region in enumerate(self.regions):
            region.index_copy_(0, idx, region_rows(seeds, r, region.shape[1]).to(self.device))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # "compute" has landed before store

    def _check(self, keys: Sequence[bytes], gids: Sequence[int]) -> list[int]:
        """Positions whose bytes differ from what their key must hold (all regions, every byte)."""
        seeds = key_patterns(keys)
        idx = torch.tensor(gids, dtype=torch.long, device=self.device)
        bad = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
        for r, region in enumerate(self.regions):
            expect = region_rows(seeds, r, region.shape[1]).to(self.device)
            bad |= (region.index_select(0, idx) != expect).any(dim=1)
        return bad.nonzero().flatten().tolist()

    # -- admission ---------------------------------------------------------------------------
    async def _admit(self, keys: Sequence[bytes]) -> tuple[int, list[int]]:
        async with self._admission:
            while True:
                grant = self.gpu.try_acquire(keys)
                if grant is not None:
                    return grant
                self._freed.clear()
                await self._freed.wait()

    def _tiers(self, keys: Sequence[bytes]) -> list[str]:
        """Tier of each key of a lookup's leading run, read in the same loop step as the lookup."""
        return self.cache.tiers_of(keys)

    # -- one request -----------------------------------------------------------------------------
    async def run_request(self, req: Request) -> None:
        s = self.stats
        ids = req.hash_ids
        s.requests += 1
        s.block_refs += len(ids)
        if len(ids) > self.gpu.num_blocks:
            # Cut before hashing: a chained key depends only on the ids before it.
            s.truncated += len(ids) - self.gpu.num_blocks
            ids = ids[: self.gpu.num_blocks]
        keys = self.cache.keyer.keys_for_block_ids(ids)  # unsigned 64-bit ids are fine
        if not keys:
            return
        n_gpu, gids = await self._admit(keys)
        ok = False
        try:
            await self._serve(keys, gids, n_gpu)
            ok = True
        finally:
            self.gpu.finish(keys, gids, publish=ok)
            self._freed.set()

    async def _serve(self, keys: list[bytes], gids: list[int], n_gpu: int) -> None:
        s = self.stats
        cache = self.cache
        s.hits_gpu += n_gpu
        rest, rest_ids = keys[n_gpu:], gids[n_gpu:]
        if not rest:
            return
        hit = cache.lookup(rest)
        tiers = self._tiers(rest[: hit.total])
        s.lookup_in_flight += hit.in_flight
        n = 0
        if hit.total:
            t0 = time.perf_counter()
            n = await cache.load(rest[: hit.total], rest_ids[: hit.total])
            s.load_latency.append(time.perf_counter() - t0)
        if n:
            bad = await self._on_compute(self._check, rest[:n], rest_ids[:n])
            s.verified += n - len(bad)
            s.corrupt += len(bad)
            served = tiers[:n]
            for i in bad:
                served[i] = "corrupt"  # served wrong bytes: not a hit; recomputed below
            s.hits_cpu += served.count("cpu")
            s.hits_disk += served.count("disk")
            if bad:
                await self._on_compute(self._write, [rest[i] for i in bad], [rest_ids[i] for i in bad])
        new, new_ids = rest[n:], rest_ids[n:]
        if not new:
            return
        await self._on_compute(self._write, new, new_ids)
        s.computed += len(new)
        t0 = time.perf_counter()
        res = await cache.store(new, new_ids)
        s.store_latency.append(time.perf_counter() - t0)
        s.stored += res.stored
        s.deduped += res.deduped
        s.store_in_flight += res.in_flight
        s.store_skipped += res.skipped


async def run_requests(
    engine: EngineEmulator,
    requests: Sequence[Request],
    *,
    concurrency: int,
    speed: float = 0.0,
    on_done: Callable[[], None] | None = None,
) -> None:
    """Run ``requests`` in order with ``concurrency`` workers; paced by timestamp / speed if speed > 0."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    t_first = requests[0].timestamp_ms if requests else 0.0
    it = iter(requests)

    async def worker() -> None:
        for req in it:  # a shared iterator: requests start in trace order
            if speed > 0:
                delay = start + (req.timestamp_ms - t_first) / 1000.0 / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            await engine.run_request(req)
            if on_done is not None:
                on_done()

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, min(concurrency, len(requests))))]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:  # one failed: stop the others before the cache closes
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
