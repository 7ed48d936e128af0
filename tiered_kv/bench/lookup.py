"""``cache.lookup`` of a resident prefix vs a plain dict-membership loop over the same keys.

The dict loop is the bar the issue sets (a lookup at most 1.5x its time), not
the fastest possible lookup: ours may beat it, so no broken-bench warning here.
Both run inside one event loop, interleaved; a sample is ``calls`` back-to-back
lookups of the whole prefix.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..cache import TieredKVCache
from ..errors import TieredKVError
from ..layout import KVLayout
from ..loops import run as run_loop
from .rig import fresh_keys
from .stats import Spread, interleave


def bench_lookup(prefix: int = 1000, *, rounds: int = 15, calls: int = 50) -> dict:
    """Synchronous (runs its own loop)."""
    return run_loop(_lookup(prefix, rounds, calls))


async def _lookup(prefix: int, rounds: int, calls: int) -> dict:
    gpu = torch.zeros((8, 64), dtype=torch.uint8)
    layout = KVLayout.from_tensors({"kv": gpu}, 8)
    cfg = {
        "model": {"bytes_per_block": 64},
        "gpu": {"num_blocks": 8},
        "tiers": {"cpu": {"capacity": 64 * 4 * prefix, "pin_memory": "off"}, "disk": {"enabled": False}},
    }
    async with TieredKVCache(cfg, layout) as cache:
        rng = np.random.default_rng(prefix)
        cpu = cache.manager.cpu
        # Resident without copies (bookkeeping only), among as many other resident keys.
        cpu.commit(cpu.reserve(fresh_keys(rng, prefix, cache.keyer.key_bytes)))
        keys = fresh_keys(rng, prefix, cache.keyer.key_bytes)
        cpu.commit(cpu.reserve(keys))
        plain = cpu.resident()  # the same keys in a dict: key -> slot

        def dict_loop() -> int:
            n = 0
            for key in keys:
                if key not in plain:
                    break
                n += 1
            return n

        if cache.lookup(keys).total != prefix or dict_loop() != prefix:
            raise TieredKVError("bench: lookup did not see the whole resident prefix")

        async def raw(_i: int) -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                dict_loop()
            return (time.perf_counter() - t0) / calls

        async def ours(_i: int) -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                cache.lookup(keys)
            return (time.perf_counter() - t0) / calls

        raw_s, ours_s = await interleave({"dict loop": raw}, ours, rounds)
    dict_s = raw_s["dict loop"]
    return {
        "prefix": prefix, "resident_blocks": 2 * prefix, "calls_per_sample": calls, "rounds": rounds,
        "raw_us": Spread.of([t * 1e6 for t in dict_s]).as_dict(2),
        "ours_us": Spread.of([t * 1e6 for t in ours_s]).as_dict(2),
        # The target is a time ratio, ours / dict loop (<= 1.5), taken per round.
        "time_ratio": Spread.of([o / r for r, o in zip(dict_s, ours_s, strict=True)]).as_dict(),
    }  # fmt: skip
