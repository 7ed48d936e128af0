"""What users get (issue 46, item 1): one call in flight (latency) and N in flight (throughput), store and load
started together, the host time per call split into the engine's share and the cache's, runs of slots per call.

Per case (block size x regions), through a real TieredKVCache with the engine ``transfer.engine: auto``
picks (the host engine on CPU tensors, the CUDA engine on a GPU), in steady state (the tier full, every
store evicting, loads of resident keys):
- ``inflight`` rows, for each op and N in ``depths``: a sample starts N 64-block calls together
  (``asyncio.gather``) and waits for all; the raw side copies the same N batches back to back (the fastest
  correct raw copy, bench/raw.py) and waits once. ``ratio``: raw time / ours per round, so N = 1 is the
  latency figure and larger N the throughput one. ``host_us``: the loop thread's CPU time per call, and of
  it the engine's entry points (``engine``; the host engine's inline memcpy included) and the rest
  (``cache``). ``slot_runs``: runs of consecutive CPU slots per call.
- a ``both`` row: one store and one load started together against each alone in the same round;
  ``ratio`` = 2 x the faster direction's time alone / the pair's time (2.0: both directions at full speed),
  the issue's "both ways / one way"; ``overlap`` = the two alone back to back / the pair (1.0: no overlap).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ..errors import TieredKVError
from ..loops import run as run_loop
from ..transfer import make_engine
from ..transfer.engines.base import Direction
from .counted import SubmitClock
from .raw import Batch, RawCopies
from .rig import BATCH, engine_tensors, fresh_keys, open_cache
from .stats import Spread, compare, fastest, gc_paused, interleave

DEPTHS = (1, 2, 4, 8)
BLOCK_SIZES = (16 << 10, 256 << 10)  # the GPU section adds 2 MiB
REGIONS = 8


def bench_inflight(block_sizes=BLOCK_SIZES, regions: int = REGIONS, *, depths=DEPTHS, rounds: int = 9,
                   device: str = "cpu") -> list[dict]:  # fmt: skip
    """Rows per block size: one per (op, N) and one ``both``; synchronous (runs its own loop per case)."""
    rows: list[dict] = []
    for block_bytes in block_sizes:
        rows += run_loop(_case(block_bytes, regions, tuple(depths), rounds, device))
    return rows


async def _case(block_bytes: int, regions: int, depths: tuple[int, ...], rounds: int, device: str) -> list[dict]:
    deep = max(depths)
    num_blocks = 2 * deep * BATCH  # N calls in flight never share a GPU block
    cpu_slots = 4 * deep * BATCH  # half of it resident for the loads, the rest turned over by the stores
    gpu = engine_tensors(block_bytes, regions, num_blocks, device)
    rng = np.random.default_rng(block_bytes + regions)
    clocks: list[SubmitClock] = []

    def clocked(slabs):  # the cache's own engine, its entry points timed (before the handlers take them)
        engine = make_engine("auto", gpu, slabs.regions, dma_rows=slabs.dma_rows)
        clocks.append(SubmitClock(engine))
        return engine

    async with open_cache(gpu, block_bytes, cpu_slots, device, engine_factory=clocked) as cache:
        clock = clocks[0]
        slabs, dev, kb = cache.slabs, gpu[0].device, cache.keyer.key_bytes
        slabs.slab.fill_(1)  # fault every slab page in before anything is timed
        raw = RawCopies(gpu, slabs.slab, slabs.offsets, BATCH)
        resident: list[list[bytes]] = []
        cursor = [0]

        def batches(n: int) -> list[Batch]:  # n calls' GPU ids, disjoint
            perm = rng.permutation(num_blocks)
            return [Batch.of(perm[i * BATCH : (i + 1) * BATCH], dev) for i in range(n)]

        async def store(keys: list[bytes], b: Batch) -> None:
            res = await cache.store(keys, b.ids_list)
            if res.stored != BATCH:
                raise TieredKVError(f"bench: a store of {BATCH} fresh keys placed {res.stored} ({res})")
            resident.append(keys)
            del resident[: -(cpu_slots // BATCH) // 2]  # the newest half: never evicted before its load

        async def load(keys: list[bytes], b: Batch) -> None:
            if (got := await cache.load(keys, b.ids_list)) != BATCH:
                raise TieredKVError(f"bench: a load of resident keys returned {got}")

        def next_first() -> int:  # the raw side's slab rows: runs of BATCH rows, cycled
            cursor[0] = (cursor[0] + 1) % (cpu_slots // BATCH)
            return cursor[0] * BATCH

        for _ in range(cpu_slots // BATCH + 2):  # fill the tier: every timed store evicts
            await store(fresh_keys(rng, BATCH, kb), batches(1)[0])
        calls = {"store": store, "load": load}
        rows = []
        for op in ("store", "load"):
            cands = raw.checked(op, batches(1)[0], 0)
            for n in depths:
                rows.append(await _depth(op, n, calls[op], cands, raw, batches, next_first, resident, clock, rng, kb,
                                         rounds))  # fmt: skip
        rows.append(await _both(store, load, batches, resident, rng, kb, rounds))
        path = cache.stats()["copy_path"]
    for row in rows:
        row.update(block_bytes=block_bytes, regions=regions, copy_path=path)
    return rows


async def _depth(op, n, call, cands, raw, batches, next_first, resident, clock, rng, kb, rounds) -> dict:
    """``n`` calls of ``op`` started together, against the raw copies of the same ``n`` batches."""
    work = [batches(n) for _ in range(rounds + 1)]
    host: list[tuple[float, float]] = []  # per sample: loop CPU seconds, engine seconds

    def sampler(fn):
        async def run(i: int) -> float:
            firsts = [next_first() for _ in work[i]]
            with gc_paused():
                t0 = time.perf_counter()
                for b, a in zip(work[i], firsts, strict=True):
                    fn(b, a)
                raw.finish()
                return time.perf_counter() - t0

        return run

    async def ours(i: int) -> float:
        # Loads rotate over the resident batches (distinct within a sample): the source is never cache-hot.
        keys = ([fresh_keys(rng, BATCH, kb) for _ in range(n)] if op == "store"
                else [resident[(i * n + k) % len(resident)] for k in range(n)])  # fmt: skip
        clock.take()
        with gc_paused():
            c0, t0 = time.thread_time(), time.perf_counter()
            await asyncio.gather(*(call(k, b) for k, b in zip(keys, work[i], strict=True)))
            dt = time.perf_counter() - t0
            host.append((time.thread_time() - c0, clock.take()))
        return dt

    raw_s, ours_s = await interleave({name: sampler(fn) for name, fn in cands.items()}, ours, rounds)
    best = fastest(raw_s)
    nbytes = n * BATCH * raw.slab.shape[1]
    host = host[-rounds:]
    direction = Direction.STORE if op == "store" else Direction.LOAD
    return {
        "op": op, "inflight": n, "batch": BATCH, "raw_method": best, **compare(raw_s[best], ours_s, nbytes),
        "host_us": {"whole": Spread.of([c * 1e6 / n for c, _ in host]).as_dict(2),
                    "engine": Spread.of([e * 1e6 / n for _, e in host]).as_dict(2),
                    "cache": Spread.of([(c - e) * 1e6 / n for c, e in host]).as_dict(2)},
        "slot_runs": Spread.of(clock.slot_runs(direction, rounds * n) or [0]).as_dict(2),
    }  # fmt: skip


async def _both(store, load, batches, resident, rng, kb: int, rounds: int) -> dict:
    """One store and one load started together vs each alone, in the same round."""
    alone: dict[str, list[float]] = {"store": [], "load": []}
    pair: list[float] = []
    for i in range(rounds + 1):
        (bs, bl), keys = batches(2), fresh_keys(rng, BATCH, kb)
        t0 = time.perf_counter()
        await store(keys, bs)
        t1 = time.perf_counter()
        await load(resident[-2], bl)
        t2 = time.perf_counter()
        (bs, bl), keys = batches(2), fresh_keys(rng, BATCH, kb)
        await asyncio.gather(store(keys, bs), load(resident[-3], bl))
        t3 = time.perf_counter()
        if i:  # round 0 warms up
            alone["store"].append(t1 - t0)
            alone["load"].append(t2 - t1)
            pair.append(t3 - t2)
    one = [min(s, ld) for s, ld in zip(alone["store"], alone["load"], strict=True)]
    return {
        "op": "both", "inflight": 2, "batch": BATCH, "rounds": rounds,
        "ratio": Spread.of([2 * o / p for o, p in zip(one, pair, strict=True)]).as_dict(),
        # The two alone one after the other / the pair: 1.0 no overlap, 2.0 full (for directions of one speed).
        "overlap": Spread.of([(s + ld) / p for s, ld, p in zip(alone["store"], alone["load"], pair, strict=True)]).as_dict(),
        "store_alone_s": Spread.of(alone["store"]).as_dict(9), "load_alone_s": Spread.of(alone["load"]).as_dict(9),
        "both_s": Spread.of(pair).as_dict(9),
    }  # fmt: skip
