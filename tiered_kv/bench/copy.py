"""Store and load through TieredKVCache vs the raw copy of the same bytes (CPU tier, host or CUDA engine).

Per case (block size x regions per block), in steady state:
- the engine tensors and the CPU slab are written before anything is timed, so
  no side pays first-touch page faults;
- the CPU tier is filled first and every timed store brings fresh keys, so each
  store evicts and reuses slots exactly as a running cache does; the raw store
  writes the same slab, cycling over runs of its rows;
- a sample is ``k`` calls of ``BATCH`` blocks, k chosen so that a sample moves
  at least ``sample_bytes``; ours awaits each call before the next;
- raw and ours alternate over the rounds (stats.interleave), then the cache's
  bytes are checked against the engine tensors.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np

from ..errors import TieredKVError
from ..loops import run as run_loop
from .raw import Batch, RawCopies, RawCopy
from .rig import BATCH, WORKING_SET, engine_tensors, fresh_keys, open_cache, random_ids
from .stats import MIN_ROUNDS, compare, fastest, interleave

BLOCK_SIZES = (16 << 10, 256 << 10, 2 << 20)
REGIONS = (8, 128)
MAX_ROUNDS = 15


def bench_copies(block_sizes=BLOCK_SIZES, regions=REGIONS, *, sample_bytes: int = 4 << 20,
                 round_bytes: int = 256 << 20, working_set: int = WORKING_SET, device: str = "cpu") -> list[dict]:
    """One store row and one load row per (block size, regions); synchronous (runs its own loop).

    Short samples taken in many rounds beat long ones on a shared machine: a pair
    taken moments apart sees the same neighbours. Each case runs
    ``round_bytes / sample`` rounds, at least MIN_ROUNDS and at most MAX_ROUNDS.
    """
    rows: list[dict] = []
    for block_bytes in block_sizes:
        for n_regions in regions:
            rows += run_loop(_case(block_bytes, n_regions, sample_bytes, round_bytes, working_set, device))
    return rows


async def _case(block_bytes: int, n_regions: int, sample_bytes: int, round_bytes: int, working_set: int,
                device: str) -> list[dict]:  # fmt: skip
    calls = max(1, sample_bytes // (BATCH * block_bytes))  # calls per sample
    per_sample = calls * BATCH
    rounds = min(MAX_ROUNDS, max(MIN_ROUNDS, round_bytes // (per_sample * block_bytes)))
    num_blocks = max(2 * BATCH, working_set // block_bytes)
    cpu_slots = max(2 * per_sample, working_set // block_bytes)
    gpu = engine_tensors(block_bytes, n_regions, num_blocks, device)
    rng = np.random.default_rng(block_bytes + n_regions)
    dev = gpu[0].device
    async with open_cache(gpu, block_bytes, cpu_slots, device) as cache:
        slabs = cache.slabs
        slabs.slab.fill_(1)  # fault every slab page in before anything is timed
        raw = RawCopies(gpu, slabs.slab, slabs.offsets, BATCH)
        runs = cpu_slots // BATCH  # raw destinations: runs of BATCH rows, cycled
        cursor = [0]

        def next_first() -> int:
            cursor[0] += 1
            return (cursor[0] % runs) * BATCH

        def new_batches(n: int) -> list[Batch]:
            return [Batch.of(random_ids(rng, num_blocks), dev) for _ in range(n)]

        kb = cache.keyer.key_bytes
        stored: list[list[bytes]] = []

        async def store(keys: list[bytes], b: Batch) -> None:
            res = await cache.store(keys, b.ids_list)
            if res.stored != len(keys):
                raise TieredKVError(f"bench: a store of {len(keys)} fresh keys placed {res.stored} ({res})")
            stored.append(keys)

        for _ in range(cpu_slots // BATCH):  # fill the tier: every timed store below evicts
            await store(fresh_keys(rng, BATCH, kb), new_batches(1)[0])

        # -- store --------------------------------------------------------------------
        total = 1 + rounds  # one warm-up round
        store_batches = [new_batches(calls) for _ in range(total)]
        store_keys = [[fresh_keys(rng, BATCH, kb) for _ in range(calls)] for _ in range(total)]

        async def ours_store(i: int) -> float:
            t0 = time.perf_counter()
            for keys, b in zip(store_keys[i], store_batches[i], strict=True):
                await store(keys, b)
            return time.perf_counter() - t0

        raws = raw.checked("store", store_batches[0][0], 0)
        raw_s, ours_s = await interleave(_samplers(raws, raw, store_batches, next_first), ours_store, rounds)
        b = new_batches(1)[0]
        await store(fresh_keys(rng, BATCH, kb), b)
        _check_rows(cache, raw, stored[-1], b, "store")
        store_row = _row("store", block_bytes, n_regions, per_sample, raw_s, ours_s)

        # -- load ---------------------------------------------------------------------
        resident = stored[-(cpu_slots // BATCH) :]
        load_batches = [new_batches(calls) for _ in range(total)]
        turn = [0]

        async def ours_load(i: int) -> float:
            keys = []
            for _ in range(calls):  # rotate over the resident batches: the source is never cache-hot
                turn[0] += 1
                keys.append(resident[turn[0] % len(resident)])
            t0 = time.perf_counter()
            got = [await cache.load(k, b.ids_list) for k, b in zip(keys, load_batches[i], strict=True)]
            dt = time.perf_counter() - t0
            if got != [BATCH] * calls:
                raise TieredKVError(f"bench: loads of resident keys returned {got}, expected {BATCH} each")
            return dt

        raws = raw.checked("load", load_batches[0][0], 0)
        raw_s, ours_s = await interleave(_samplers(raws, raw, load_batches, next_first), ours_load, rounds)
        b = new_batches(1)[0]
        if await cache.load(resident[-1], b.ids_list) != BATCH:
            raise TieredKVError("bench: the check load missed")
        _check_rows(cache, raw, resident[-1], b, "load")
        load_row = _row("load", block_bytes, n_regions, per_sample, raw_s, ours_s)
        path = cache.stats()["copy_path"]  # the copy path the engine chose at start (issue 38)
    return [{**store_row, "copy_path": path}, {**load_row, "copy_path": path}]


def _samplers(raws: dict[str, RawCopy], raw: RawCopies, batches: list[list[Batch]],
              next_first: Callable[[], int]) -> dict[str, Callable[[int], Awaitable[float]]]:  # fmt: skip
    """Each raw candidate as a sampler: sample i copies ``batches[i]`` to or from fresh runs of slab rows."""

    def sampler(fn: RawCopy) -> Callable[[int], Awaitable[float]]:
        async def run(i: int) -> float:
            firsts = [next_first() for _ in batches[i]]
            t0 = time.perf_counter()
            for b, a in zip(batches[i], firsts, strict=True):
                fn(b, a)
            raw.finish()
            return time.perf_counter() - t0

        return run

    return {name: sampler(fn) for name, fn in raws.items()}


def _check_rows(cache, raw: RawCopies, keys: list[bytes], b: Batch, op: str) -> None:
    """The slab rows now holding ``keys`` equal the engine rows ``b.ids``, region by region."""
    slots = cache.manager.cpu.find_ready(keys)
    if (slots < 0).any():
        raise TieredKVError(f"bench: after the {op} check, {int((slots < 0).sum())} keys are not resident")
    if not raw.holds(slots, b):
        raise TieredKVError(f"bench: the cache's {op} moved the wrong bytes")


def _row(op: str, block_bytes: int, regions: int, per_sample: int, raw_s: dict[str, list[float]],
         ours_s: list[float]) -> dict:
    nbytes = per_sample * block_bytes
    best = fastest(raw_s)
    return {
        "op": op, "block_bytes": block_bytes, "regions": regions, "region_bytes": block_bytes // regions,
        "batch": BATCH, "blocks_per_sample": per_sample, "raw_method": best,
        "raw_candidates_gbps": {k: round(nbytes / statistics.median(v) / 1e9, 3) for k, v in raw_s.items()},
        **compare(raw_s[best], ours_s, nbytes),
    }  # fmt: skip
