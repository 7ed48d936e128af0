"""1,000 concurrent mixed put/get/exists with random cancellation against a real redis-server.

Bounded in count and time, loopback only. Ends with the pool healthy: no connection held, none
beyond max_concurrency open on the server, the tier not degraded, and a batch byte-exact."""

from __future__ import annotations

import asyncio
import random

import numpy as np
from redis_helpers import BPB, block_bytes, fill, key_rows, metrics, pool_in_use, remote_cfg

import tiered_kv as tkv
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.tiers.remote import RemoteStore

OPS, STORED, CONC = 1000, 200, 8


async def test_thousand_concurrent_ops_with_cancellation(redis_server):
    slabs = CpuSlabs(tkv.KVLayout.from_block_bytes([8192, 512], num_blocks=4), STORED + OPS * 4, pin="off")
    store = await RemoteStore.open(remote_cfg(redis_server.url, max_concurrency=CONC, timeout=5.0), "ns-load", slabs, metrics())
    try:
        stored = key_rows("stored", STORED)
        fill(slabs, range(STORED), stored)
        assert (await store.put(stored, np.arange(STORED))).all()
        rng = random.Random(7)
        results: list[tuple[str, np.ndarray, np.ndarray, asyncio.Task]] = []
        for op in range(OPS):
            n = rng.randint(1, 4)
            dst = STORED + op * 4 + np.arange(n)  # each op has its own rows
            kind = rng.choice(("put", "get", "get", "exists"))
            if kind == "put":
                keys = key_rows(f"new{op}", n)
                fill(slabs, dst, keys)
                coro = store.put(keys, dst)
            else:
                keys = stored[rng.sample(range(STORED), n)]
                coro = store.get(keys, dst) if kind == "get" else store.exists(keys)
            results.append((kind, keys, dst, asyncio.create_task(coro)))
            if op % 7 == 0:
                await asyncio.sleep(0)
        for _, _, _, task in rng.sample(results, OPS // 4):
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.05), task.cancel)
        await asyncio.wait_for(asyncio.gather(*(t for *_, t in results), return_exceptions=True), 60)
        cancelled = finished = 0
        for kind, keys, dst, task in results:
            if task.cancelled():
                cancelled += 1
                continue
            assert task.exception() is None, task.exception()
            ok = task.result()
            finished += 1
            assert ok.all(), (kind, ok)  # the server was healthy throughout: every finished op succeeded
            if kind == "get":
                for row, k in zip(dst, keys, strict=True):
                    assert np.array_equal(slabs.slab_np[row], block_bytes(k.tobytes()))
        assert cancelled > 0 and finished > 0
        assert not store.degraded
        assert pool_in_use(store) == 0
        clients = int(redis_server.cli("info", "clients").split("connected_clients:")[1].split()[0])
        assert clients <= CONC + 1, clients  # + redis-cli itself
        slabs.slab_np[STORED : 2 * STORED] = 0  # the pool is still in step: a full batch byte-exact
        assert (await store.get(stored, np.arange(STORED, 2 * STORED))).all()
        for i in range(STORED):
            assert np.array_equal(slabs.slab_np[STORED + i], block_bytes(stored[i].tobytes()))
        assert BPB == slabs.bytes_per_block
    finally:
        await store.aclose()
        slabs.release()
