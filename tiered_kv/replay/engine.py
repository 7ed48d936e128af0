"""The engine emulator: a GPU prefix cache over real KV tensors, driving a real TieredKVCache.

Per request: take the leading GPU hits, ask the cache for the rest, load them,
check every loaded byte against what its key must hold, "compute" the misses by
writing key-derived bytes, then publish the blocks in the GPU prefix cache (last
block first, so a request's head is the most recent).

Exclusive mode (the default) treats the GPU as the top of one exclusive
hierarchy: a block goes to the cache when the GPU prefix cache evicts it (its
store finishes before the GPU block is reused), and loads are ``exclusive`` (the
cache's copy becomes a first eviction candidate). GPU + CPU + disk then hold
each block once, like one flat LRU of their total size. Inclusive mode stores
every computed block at once, as vLLM's connectors do, with the request's
earlier blocks as the ``prefix``.

A request's partial last block (``input_length`` not a multiple of the block
size) takes no cache slot when ``drop_partial``: its id changes once the next
turn fills it, so it is never reused as such; it counts as computed. Kept, it
is put at the cold end of the tiers after every store, touch and load of it (as
the vLLM connector keeps its partial tail records): the first to go under pressure.

With ``hints``, requests that carry a session register their chain with the
cache (``touch(session=)``), and a session's last turn releases it: the blocks
no live session shares become the first eviction candidates here and in the cache.

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
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import TieredKVCache
from .gpu_cache import GpuPrefixCache
from .trace import Request

SEED_BYTES = 64  # per-key pattern, tiled over a region row: cheap to make and to compare
PARTIALS_CAP = 1 << 16  # kept partial last blocks remembered as such


# -- expected bytes ---------------------------------------------------------------------
def key_patterns(keys: Sequence[bytes]) -> torch.Tensor:
    """``[len(keys), SEED_BYTES]`` uint8: the bytes each key's block repeats."""
    raw = b"".join(hashlib.blake2b(k, digest_size=SEED_BYTES).digest() for k in keys)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(keys), SEED_BYTES)


def region_rows(seeds: torch.Tensor, region: int, row_bytes: int) -> torch.Tensor:
    """Expected rows of one region: the seed shifted by the region index (a swap shows), tiled."""
    reps = -(-row_bytes // SEED_BYTES)
    return (seeds + region).repeat(1, reps)[:, :row_bytes]


# -- stats --------------------------------------------------------------------------------
@dataclass
class EngineStats:
    requests: int = 0
    block_refs: int = 0
    hits_gpu: int = 0
    hits_cpu: int = 0
    hits_disk: int = 0
    hits_pending: int = 0  # in flight at lookup time (being stored or promoted), loaded once landed
    hits_remote: int = 0  # loaded from the remote tier (Redis): written by another instance or evicted here
    computed: int = 0
    truncated: int = 0  # blocks past num_blocks of a request longer than the GPU
    stored: int = 0
    deduped: int = 0
    store_in_flight: int = 0
    store_skipped: int = 0
    demoted: int = 0  # of ``stored``: blocks stored when the GPU evicted them (exclusive mode)
    partial_dropped: int = 0  # partial last blocks never published or stored
    released: int = 0  # blocks of ended sessions made first eviction candidates
    lookup_in_flight: int = 0  # lookups whose run included blocks still in flight (load waits for them)
    verified: int = 0
    corrupt: int = 0
    load_latency: list[float] = field(default_factory=list)
    store_latency: list[float] = field(default_factory=list)


# -- the emulator -------------------------------------------------------------------------
class EngineEmulator:
    """Runs requests against ``cache``; ``regions`` are the KV tensors the cache's layout binds."""

    def __init__(
        self,
        cache: TieredKVCache,
        regions: Sequence[torch.Tensor],
        *,
        exclusive: bool = True,
        drop_partial: bool = True,
        block_tokens: int = 512,
        hints: bool = False,
    ) -> None:
        self.cache = cache
        self.regions = list(regions)
        self.device = self.regions[0].device
        self.gpu = GpuPrefixCache(self.regions[0].shape[0])
        self.exclusive = exclusive
        self.drop_partial = drop_partial
        self.block_tokens = block_tokens
        self.hints = hints
        self._partials: dict[bytes, None] = {}  # kept partial last blocks' keys (oldest first, bounded)
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
    async def _admit(self, keys: Sequence[bytes]) -> tuple[int, list[int], list[tuple[bytes, int]]]:
        async with self._admission:
            while True:
                grant = self.gpu.try_acquire(keys)
                if grant is not None:
                    return grant
                self._freed.clear()
                await self._freed.wait()

    async def _demote(self, evicted: list[tuple[bytes, int]], after: Awaitable[Any] | None = None) -> None:
        """Store the blocks the GPU evicted, before their GPU blocks are rewritten (exclusive mode)."""
        # Newest first: the cache makes the first key of a call the most recent.
        keys = [k for k, _ in reversed(evicted)]
        gids = [g for _, g in reversed(evicted)]
        t0 = time.perf_counter()
        res = await self.cache.store(keys, gids, after=after)
        self._cool(keys)
        s = self.stats
        s.store_latency.append(time.perf_counter() - t0)
        s.stored += res.stored
        s.demoted += res.stored
        s.deduped += res.deduped
        s.store_in_flight += res.in_flight
        s.store_skipped += res.skipped

    def _cool(self, keys: Sequence[bytes]) -> None:
        """Kept partial last blocks among ``keys`` go (back) to the cold end of every tier."""
        if self._partials:
            cold = [k for k in keys if k in self._partials]
            if cold:
                self.cache.manager.demote(cold)

    def _tiers(self, keys: Sequence[bytes]) -> list[str]:
        """Tier of each key of a lookup's leading run, read in the same loop step as the lookup."""
        return self.cache.tiers_of(keys)

    # -- one request -----------------------------------------------------------------------------
    async def run_request(self, req: Request) -> None:
        s = self.stats
        ids = req.hash_ids
        s.requests += 1
        s.block_refs += len(ids)
        publish = len(ids)
        if self.drop_partial and req.input_length % self.block_tokens:
            publish -= 1  # the partial last block is never reused as such
            s.partial_dropped += 1
        if len(ids) > self.gpu.num_blocks:
            # Cut before hashing: a chained key depends only on the ids before it.
            s.truncated += len(ids) - self.gpu.num_blocks
            ids = ids[: self.gpu.num_blocks]
            publish = min(publish, len(ids))
        if publish < len(ids):
            # The partial last block is computed in the request's working memory: it never holds
            # a cache slot, here or below (a flat cache that drops partial blocks never inserts it).
            s.computed += len(ids) - publish
            ids = ids[:publish]
        keys = self.cache.keyer.keys_for_block_ids(ids)  # unsigned 64-bit ids are fine
        if keys and publish == len(req.hash_ids) and req.input_length % self.block_tokens:
            self._partials[keys[-1]] = None  # kept (not dropped, not cut): stays at the cold end
            if len(self._partials) > PARTIALS_CAP:
                del self._partials[next(iter(self._partials))]
        if not keys:
            return
        n_gpu, gids, evicted = await self._admit(keys)
        ok = False
        try:
            # Touched before the GPU's victims go down: the blocks this request will load must
            # not be pushed out by its own demotions (a flat LRU looks them up before inserting).
            if self.hints and req.session is not None:
                self.cache.touch(keys[:publish], session=req.session, expect_followup=not req.last_turn)
            else:
                self.cache.touch(keys[n_gpu:publish])
            # The GPU's hits too (the head, so last: most recent): the cache keeps the history of
            # blocks it does not hold, so a block hit here is frequent when the GPU hands it down.
            self.cache.touch(keys[: min(n_gpu, publish)], held=True)
            self._cool(keys[-1:])  # a touch takes a kept partial block off the cold end
            await self._serve(keys, gids, n_gpu, publish, evicted if self.exclusive else [])
            await self.gpu.ready(gids[:n_gpu])  # hits another request was still computing
            ok = True
        finally:
            self.gpu.finish(keys, gids, publish if ok else 0)
            if ok and self.hints and req.session is not None and req.last_turn:
                dead = self.cache.release(req.session)
                self.gpu.release(dead)
                s.released += len(dead)
            self._freed.set()

    async def _serve(
        self, keys: list[bytes], gids: list[int], n_gpu: int, publish: int, evicted: list[tuple[bytes, int]]
    ) -> None:
        s = self.stats
        s.hits_gpu += n_gpu
        # The GPU's victims go down once, before their blocks are rewritten, and (through the
        # load's hook) after its reads: moving those blocks up frees room for the victims. The
        # store is announced at once, so other requests wait for the victims instead of missing them.
        gate = asyncio.Event()
        saving = asyncio.ensure_future(self._demote(evicted, gate.wait())) if evicted else None

        async def save_evicted() -> None:
            gate.set()
            if saving is not None:
                await asyncio.shield(saving)

        try:
            await self._serve_rest(keys, gids, n_gpu, publish, save_evicted)
        finally:
            gate.set()
            if saving is not None:
                await asyncio.gather(saving, return_exceptions=True)

    async def _serve_rest(self, keys: list[bytes], gids: list[int], n_gpu: int, publish: int,
                          save_evicted: Callable[[], Awaitable[None]]) -> None:  # fmt: skip
        s = self.stats
        cache = self.cache
        rest, rest_ids = keys[n_gpu:], gids[n_gpu:]
        if not rest:
            await save_evicted()
            return
        # With a remote tier, wait for one batched EXISTS round trip: what another instance wrote is
        # unknown to this instance's residency filter until a probe finds it.
        hit = await cache.probe(rest) if cache.remote is not None else cache.lookup(rest)
        tiers = self._tiers(rest[: hit.total])
        s.lookup_in_flight += hit.in_flight
        n = 0
        if hit.total:
            t0 = time.perf_counter()
            n = await cache.load(rest[: hit.total], rest_ids[: hit.total], exclusive=self.exclusive,
                                 before_copy=save_evicted)  # fmt: skip
            self._cool(rest[:n])
            s.load_latency.append(time.perf_counter() - t0)
        await save_evicted()
        if n:
            bad = await self._on_compute(self._check, rest[:n], rest_ids[:n])
            s.verified += n - len(bad)
            s.corrupt += len(bad)
            served = tiers[:n]
            for i in bad:
                served[i] = "corrupt"  # served wrong bytes: not a hit; recomputed below
            s.hits_cpu += served.count("cpu")
            s.hits_disk += served.count("disk")
            s.hits_remote += served.count("remote")
            s.hits_pending += served.count("")  # was in flight at lookup, loaded once it landed
            if bad:
                await self._on_compute(self._write, [rest[i] for i in bad], [rest_ids[i] for i in bad])
            self.gpu.publish(rest[:n], rest_ids[:n])
        new, new_ids = rest[n:], rest_ids[n:]
        if not new:
            return
        await self._on_compute(self._write, new, new_ids)
        s.computed += len(new)
        keep = max(0, publish - n_gpu - n)  # computed blocks worth keeping (not the partial last one)
        self.gpu.publish(new[:keep], new_ids[:keep])
        if self.exclusive or not keep:
            return  # stored when the GPU evicts them
        t0 = time.perf_counter()
        res = await cache.store(new[:keep], new_ids[:keep], prefix=keys[: n_gpu + n])
        self._cool(new[:keep])
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
