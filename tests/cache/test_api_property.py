"""Random keys, ids and cancellations through the public API: typed errors only, invariants always hold."""

from __future__ import annotations

import asyncio
import hashlib

from cache_helpers import cache_for, config, fill, make_kv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered_kv as tkv

POOL = [hashlib.sha256(f"pool{i}".encode()).digest() for i in range(12)]
JUNK_KEYS = [None, "x" * 32, b"short", True, 7, bytearray(32), b"y" * 33]
JUNK_IDS = [True, False, None, "3", 1.0, -1, 64, 10**30]

key_st = st.one_of(st.sampled_from(POOL), st.sampled_from(JUNK_KEYS))
id_st = st.one_of(st.integers(0, 63), st.sampled_from(JUNK_IDS))
op_st = st.tuples(
    st.sampled_from(["store", "load", "lookup", "touch"]),
    st.lists(key_st, min_size=0, max_size=6),
    st.lists(id_st, min_size=0, max_size=6),
    st.one_of(st.none(), st.integers(0, 3)),  # cancel after this many loop steps
)


async def _play(ops, tmp_path) -> None:
    kv = make_kv()
    cfg = config(tmp_path, cpu_blocks=6, disk_blocks=10) if tmp_path is not None else config(cpu_blocks=6)
    async with cache_for(kv, cfg) as cache:
        for i, key in enumerate(POOL):
            fill(kv, i, key)
        for name, keys, ids, cancel_after in ops:
            call = getattr(cache, name)
            args = (keys,) if name in ("lookup", "touch") else (keys, ids)
            if name in ("lookup", "touch"):
                try:
                    call(*args)
                except tkv.TieredKVError:
                    pass
                cache.check_invariants()
                continue
            task = asyncio.ensure_future(call(*args))
            if cancel_after is not None:
                for _ in range(cancel_after):
                    await asyncio.sleep(0)
                task.cancel()
            try:
                await task
            except (tkv.TieredKVError, asyncio.CancelledError):
                pass
            cache.check_invariants()
            m = cache.manager
            assert m.cpu.n_reserved == 0 or cache._tasks, "a reservation outlived every call"
        while cache._tasks:
            await asyncio.sleep(0.001)
        cache.check_invariants()
        assert not cache.manager.cpu.pins.any(), "pins left after every call returned"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=1, max_size=25), with_disk=st.booleans())
def test_random_public_calls_raise_typed_errors_and_keep_invariants(ops, with_disk, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prop") if with_disk else None
    asyncio.run(_play(ops, tmp))
