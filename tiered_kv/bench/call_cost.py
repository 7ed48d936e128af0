"""The cache's own host time per 64-block call (issue 46, item 7): everything but the engine's copy.

A real TieredKVCache over ``CountedEngine`` (counted.py: the ids are checked as every engine checks
them, the launch is recorded, the batch completes on the next loop turn), so a call's time is the
cache's own: argument checks, planning, the runners' iterations and futures, the engine's submit
(validation and the counted launch, reported apart as the engine's share), completion and commit.
Cases: the CPU tier alone, and a disk tier below it with ``write_through`` (each store also queues its
64 blocks for disk) under lru, arc and window. The tiers are full, so every store evicts. Stores bring
fresh keys; loads read resident ones. The bar, as in the lookup bench, is a dict-insert loop of the
call's 64 keys, interleaved with ours; the issue's target: at most 100 us per call
(the cache's share, ``cache_us``; targets.TARGETS).

Time is the loop thread's CPU time (``time.thread_time``): the disk writes run on the DiskStore's
threads and are not the cache's bookkeeping; what the loop does to start and finish them is.
``profile_parts`` splits the same calls with cProfile into the parts the issue names.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import tempfile
import time

import numpy as np
import torch

from ..cache import TieredKVCache
from ..errors import TieredKVError
from ..layout import KVLayout
from ..loops import run as run_loop
from ..transfer.engines.base import Direction
from .call_floor import floor_us
from .counted import CountedEngine, SubmitClock
from .rig import BATCH, fresh_keys
from .sections import SECTION_NAMES, Sections
from .stats import Spread, gc_paused, interleave

BLOCK = 4096  # bytes per block: a disk record's own padding, so the disk writes stay small
CASES = (("cpu", "lru", None), ("disk", "lru", "write_through"), ("disk", "arc", "write_through"),
         ("disk", "window", "write_through"))  # fmt: skip


def bench_call_cost(*, rounds: int = 15, calls: int = 40, cpu_calls: int = 32, cases=CASES,
                    directory: str | None = None, profile: bool = True) -> list[dict]:  # fmt: skip
    """One row per (case, op); synchronous (runs its own loop per case)."""
    rows: list[dict] = []
    for tier, policy, spill in cases:
        with tempfile.TemporaryDirectory(prefix="tkv-call-cost-", dir=directory) as tmp:
            rows += run_loop(_case(tier, policy, spill, tmp, rounds, calls, cpu_calls, profile))
    return rows


def _config(tier: str, policy: str, spill: str | None, path: str, cpu_slots: int) -> dict:
    cfg: dict = {
        "model": {"bytes_per_block": BLOCK, "model_id": "tiered-kv-bench"},
        "gpu": {"num_blocks": 4 * BATCH},
        "tiers": {"cpu": {"capacity": cpu_slots * BLOCK, "pin_memory": "off"}, "disk": {"enabled": False}},
        "eviction": {"policy": policy},
    }
    if tier == "disk":
        cfg["tiers"]["disk"] = {"enabled": True, "path": path, "capacity": 2 * cpu_slots * BLOCK, "spill_policy": spill}
    return cfg


async def _case(tier: str, policy: str, spill: str | None, path: str, rounds: int, calls: int, cpu_calls: int,
                profile: bool) -> list[dict]:  # fmt: skip
    gpu = torch.zeros((4 * BATCH, BLOCK), dtype=torch.uint8)
    layout = KVLayout.from_tensors({"kv": gpu}, 4 * BATCH, block_dim=0)
    clocks: list[SubmitClock] = []

    def counted(slabs) -> CountedEngine:
        engine = CountedEngine(list(layout.regions), slabs.regions)
        clocks.append(SubmitClock(engine))
        return engine

    cache = TieredKVCache(_config(tier, policy, spill, path, cpu_calls * BATCH), layout, engine_factory=counted)
    rng = np.random.default_rng(46)
    async with cache:
        kb = cache.keyer.key_bytes
        ids = [rng.permutation(4 * BATCH)[:BATCH].tolist() for _ in range(8)]  # scattered GPU ids
        resident: list[list[bytes]] = []

        async def store(keys: list[bytes], i: int) -> None:
            res = await cache.store(keys, ids[i % len(ids)])
            if res.stored != BATCH:
                raise TieredKVError(f"bench: a store of {BATCH} fresh keys placed {res.stored} ({res})")
            resident.append(keys)
            del resident[: -cpu_calls // 2]  # the newest half of the tier: never evicted before its load

        async def load(keys: list[bytes], i: int) -> None:
            if (got := await cache.load(keys, ids[i % len(ids)])) != BATCH:
                raise TieredKVError(f"bench: a load of resident keys returned {got}")

        fill = cpu_calls * (3 if tier == "disk" else 1) + 2  # every tier full: every timed store evicts
        for i in range(fill):
            await store(fresh_keys(rng, BATCH, kb), i)
        await cache._tasks.drain()  # the fill's disk writes landed
        clock = clocks[0]
        rows = []
        for op in ("store", "load"):
            row = await _op_row(op, cache, clock, store if op == "store" else load, rng, resident, rounds, calls)
            row.update(tier=tier, policy=policy, spill_policy=spill)
            if tier == "cpu":  # the same manager and engine with nothing between (call_floor.py)
                batches = ([fresh_keys(rng, BATCH, kb) for _ in range(3 * calls)] if op == "store"
                           else [resident[-1 - (k % len(resident))] for k in range(3 * calls)])  # fmt: skip
                row["floor_us"] = await floor_us(cache, op, batches, ids)
                if op == "store":  # the newest half of the tier: what the loads read next
                    resident[:] = batches[-(cpu_calls // 2) :]
            if profile:
                row["profile_us"] = await profile_parts(store if op == "store" else load, op, rng, kb, resident, calls,
                                                      row["ours_us"]["median"])  # fmt: skip
                await cache._tasks.drain()
            rows.append(row)
        clock.restore()
    return rows


async def _op_row(op: str, cache: TieredKVCache, clock: SubmitClock, call, rng, resident: list[list[bytes]],
                  rounds: int, calls: int) -> dict:  # fmt: skip
    """``calls`` calls of ``op`` per sample, against the dict-insert loop of the same number of 64-key calls."""
    kb = cache.keyer.key_bytes
    work = [[fresh_keys(rng, BATCH, kb) for _ in range(calls)] for _ in range(rounds + 1)]
    d: dict[bytes, int] = {}
    engine_s: list[float] = []

    async def raw(i: int) -> float:  # the bar: insert the call's 64 keys into a dict
        d.clear()
        with gc_paused():
            t0 = time.thread_time()
            for keys in work[i]:
                for j, key in enumerate(keys):
                    d[key] = j
            return (time.thread_time() - t0) / calls

    async def sample(i: int | None) -> tuple[float, float]:
        """Seconds per call: the loop thread's CPU time, and of it the engine's entry points. Stores take
        ``work[i]`` (None: keys never seen), loads resident keys."""
        if op == "store":
            batch = work[i] if i is not None else [fresh_keys(rng, BATCH, kb) for _ in range(calls)]
        else:
            batch = [resident[-1 - (k % len(resident))] for k in range(calls)]
        clock.take()
        with gc_paused():
            t0 = time.thread_time()
            for k, keys in enumerate(batch):
                await call(keys, k)
            dt = (time.thread_time() - t0) / calls
            engine = clock.take() / calls
        await cache._tasks.drain()  # the background disk writes: their loop-side work was counted above
        return dt, engine

    async def ours(i: int) -> float:
        dt, engine = await sample(i)
        engine_s.append(engine)
        return dt

    raw_s, ours_s = await interleave({"dict insert loop": raw}, ours, rounds)
    dict_s, engine_s = raw_s["dict insert loop"], engine_s[-rounds:]  # the warm-up round dropped
    sections = await _sections(cache, sample, rounds, calls)
    direction = Direction.STORE if op == "store" else Direction.LOAD
    return {
        "op": op, "batch": BATCH, "rounds": rounds, "calls_per_sample": calls,
        "raw_us": Spread.of([t * 1e6 for t in dict_s]).as_dict(2),
        "ours_us": Spread.of([t * 1e6 for t in ours_s]).as_dict(2),
        "engine_us": Spread.of([t * 1e6 for t in engine_s]).as_dict(2),
        "cache_us": Spread.of([(o - e) * 1e6 for o, e in zip(ours_s, engine_s, strict=True)]).as_dict(2),
        "time_ratio": Spread.of([o / r for r, o in zip(dict_s, ours_s, strict=True)]).as_dict(),
        "slot_runs_per_call": Spread.of(clock.slot_runs(direction, calls) or [0]).as_dict(2),
        "engine_calls": cache.engine.calls[direction],
        "sections_us": sections,
    }  # fmt: skip


async def _sections(cache: TieredKVCache, sample, rounds: int, calls: int) -> dict[str, float]:
    """Median us per call of each timed section (sections.py) over a few more samples; ``rest`` is what they
    and the engine's entry points leave of the call (the runners' and the loop's own work, completion)."""
    timer = Sections(cache)
    per: dict[str, list[float]] = {k: [] for k in (*SECTION_NAMES, "engine submit", "rest")}
    try:
        for _ in range(max(3, rounds // 3)):
            timer.take()
            whole, engine = await sample(None)
            got = {k: v / calls for k, v in timer.take().items()}
            for k, v in got.items():
                per[k].append(v)
            per["engine submit"].append(engine)
            per["rest"].append(whole - engine - sum(got.values()))
    finally:
        timer.restore()
    return {k: round(statistics.median(v) * 1e6, 2) for k, v in per.items()}


# The parts the issue names. A function belongs to a part by name (the manager's and the engine's entry points,
# the argument checks) or by where it lives (metrics, the disk tier with the spill runner and the DiskIO
# handler); a part's time is what its functions take when called from outside every part (callees
# included), so nothing counts twice. What no part claims (the runners' and the loop's own iterations,
# futures, completion) is "runners+loop".
NAMED = {
    "args": ("check_blocks", "call_blocks", "store_chain", "compute_for", "check_keys", "check_block_ids"),
    "plan": ("prepare_store", "prepare_load", "plan_load"),
    "engine submit": ("submit_store", "submit_load"),
    "commit": ("complete_store", "complete_load", "finish_load"),
}
PARTS = (*NAMED, "metrics", "disk (loop side)")
_DISK_FILES = ("/tiered_kv/tiers/disk/", "/tiered_kv/transfer/handlers/disk_io.py",
               "/tiered_kv/transfer/runners/spill.py", "/aiofiles/")  # fmt: skip


def _part(file: str, name: str) -> str | None:
    if any(f in file for f in _DISK_FILES):
        return "disk (loop side)"
    if file.endswith("/tiered_kv/metrics.py") or "/prometheus_client/" in file:
        return "metrics"
    short = _short(name)
    return next((part for part, names in NAMED.items() if short in names), None)


async def profile_parts(op_fn, op: str, rng, kb: int, resident: list[list[bytes]], calls: int,
                        total_us: float) -> dict[str, float]:  # fmt: skip
    """The same calls under cProfile, split into PARTS. Each part's share of the profiled time is applied to
    ``total_us`` (the unprofiled per-call figure), so the profiler's own overhead drops out."""
    batch = ([fresh_keys(rng, BATCH, kb) for _ in range(calls)] if op == "store"
             else [resident[-1 - (k % len(resident))] for k in range(calls)])  # fmt: skip
    prof = cProfile.Profile(time.thread_time)
    with gc_paused():
        prof.enable()
        t0 = time.thread_time()
        for k, keys in enumerate(batch):
            await op_fn(keys, k)
        whole = time.thread_time() - t0
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    out: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    memo: dict[tuple, str | None] = {}

    def part_of(key: tuple, depth: int = 0) -> str | None:
        """A C function (numpy's, a builtin) takes the part of its callers when they all share one: time spent
        in a part's Python through numpy.fromiter is still the part's, not a second entry into it."""
        if key not in memo:
            memo[key] = _part(key[0], key[2])
            if key[0] == "~" and key in stats and depth < 4:
                parts = {part_of(c, depth + 1) for c in stats[key][4]}
                memo[key] = parts.pop() if len(parts) == 1 else None
        return memo[key]

    for key, (_cc, _nc, _tt, cum, callers) in stats.items():
        part = part_of(key)
        if part is None:
            continue
        # The time spent here on behalf of callers outside every part (cProfile keeps it per caller).
        outside = [c[3] for ck, c in callers.items() if part_of(ck) is None]
        out[part] += sum(outside) if callers else cum
    claimed = sum(out.values())
    out["runners+loop"] = max(0.0, whole - claimed)
    scale = total_us / (whole * 1e6 / calls) if whole > 0 else 0.0
    by_module: dict[str, float] = {}  # self time (no callees) by where the code lives: sums to the whole
    for (file, _line, name), (_cc, _nc, tt, _ct, _callers) in stats.items():
        group = _module(file, name)
        by_module[group] = by_module.get(group, 0.0) + tt
    per_call = lambda d: {k: round(v * 1e6 / calls * scale, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return {"parts": per_call(out), "self_by_module": per_call(by_module)}


def _module(file: str, name: str) -> str:
    """Where a profiled function lives: ``tiered_kv/transfer/runners/store.py`` -> ``transfer/runners``, a
    package's file -> the package, C functions by their owner (the native core, numpy, builtins)."""
    if file == "~" or not file.endswith(".py"):
        return "native core" if "tiered_kv._core" in name else "numpy (C)" if "numpy" in name else "builtins"
    if "/tiered_kv/" in file:
        parts = file.split("/tiered_kv/", 1)[1].split("/")
        return "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1].split("/", 1)[0]
    return "asyncio" if "/asyncio/" in file else "stdlib"


def _short(name: str) -> str:
    """A pstats function name without its builtin wrapping: ``<method 'prepare_store' of ...>`` -> prepare_store."""
    if name.startswith("<") and "'" in name:
        return name.split("'")[1]
    return name
