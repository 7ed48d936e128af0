"""``prepare_store`` + ``complete_store`` of 64 new keys vs a dict-insert loop over the same keys.

The manager's bookkeeping of one store call (find the new keys, reserve or evict slots for them,
commit, events) against the least a Python cache could do for them: insert each key into a dict.
The CPU tier is full, so every planned store evicts 64 blocks as a running cache does; the dict
only grows. Bookkeeping only: no bytes move. The target is a time ratio (<= 2).

``disk_slots``: the same with a disk tier below the CPU (one policy over both, native/domain.hpp), so
every store also moves 64 blocks down (the spill's bookkeeping completes at once) and, once the disk is
full, the hierarchy's victims leave: the general path, not the CPU-only fused one.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import TieredKVError
from ..loops import run as run_loop
from ..manager import TierManager
from .rig import BATCH, fresh_keys
from .stats import Spread, interleave

KEY_BYTES = 32


def bench_manager(*, rounds: int = 15, calls: int = 200, slots: int = 64 * BATCH, disk_slots: int | None = None,
                  policy: str = "lru") -> dict:  # fmt: skip
    """Synchronous (runs its own loop)."""
    return run_loop(_manager(rounds, calls, slots, disk_slots, policy))


def _store(m: TierManager, keys: list[bytes], ids: np.ndarray):
    plan = m.stores.prepare(keys, ids)
    if plan.spill is not None:
        m.room.complete_spill(plan.spill, np.ones(len(plan.spill), dtype=bool))
    m.stores.complete(plan, True)
    return plan


async def _manager(rounds: int, calls: int, slots: int, disk_slots: int | None, policy: str) -> dict:
    rng = np.random.default_rng(28)
    m = TierManager(slots, disk_slots, KEY_BYTES, policy)
    ids = np.arange(BATCH, dtype=np.int64)
    for _ in range((slots + (disk_slots or 0)) // BATCH):  # full: every store below evicts
        _store(m, fresh_keys(rng, BATCH, KEY_BYTES), ids)
    m.take_events()
    batches = [[fresh_keys(rng, BATCH, KEY_BYTES) for _ in range(calls)] for _ in range(2 * rounds + 2)]
    turn = [0]

    def next_batches() -> list[list[bytes]]:
        turn[0] += 1
        return batches[turn[0] % len(batches)]

    async def raw(_i: int) -> float:
        work, d = next_batches(), {}
        t0 = time.perf_counter()
        for keys in work:
            for i, key in enumerate(keys):
                d[key] = i
        return (time.perf_counter() - t0) / calls

    async def ours(_i: int) -> float:
        work = [fresh_keys(rng, BATCH, KEY_BYTES) for _ in range(calls)]  # never seen: all new
        t0 = time.perf_counter()
        for keys in work:
            plan = _store(m, keys, ids)
        dt = (time.perf_counter() - t0) / calls
        if len(plan.cpu_slots) != BATCH:
            raise TieredKVError(f"bench: a store of {BATCH} new keys placed {len(plan.cpu_slots)}")
        m.take_events()
        return dt

    raw_s, ours_s = await interleave({"dict insert loop": raw}, ours, rounds)
    dict_s = raw_s["dict insert loop"]
    return {
        "batch": BATCH, "slots": slots, "disk_slots": disk_slots, "policy": policy, "calls_per_sample": calls,
        "rounds": rounds,
        "raw_us": Spread.of([t * 1e6 for t in dict_s]).as_dict(2),
        "ours_us": Spread.of([t * 1e6 for t in ours_s]).as_dict(2),
        "time_ratio": Spread.of([o / r for r, o in zip(dict_s, ours_s, strict=True)]).as_dict(),
    }  # fmt: skip
