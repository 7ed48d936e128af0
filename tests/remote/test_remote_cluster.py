"""RemoteStore against a real 3-node Redis Cluster on loopback: batches split by slot owner, byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
from redis_helpers import block_bytes, fill, key_rows, metrics, pool_in_use, remote_cfg

from tiered_kv.tiers.remote import RemoteStore


@pytest.mark.slow
async def test_cluster_put_get_byte_exact_across_nodes(redis_cluster, slabs):
    seeds = [f"127.0.0.1:{n.port}" for n in redis_cluster[:2]]
    cfg = remote_cfg(redis_cluster[0].url, cluster=True, nodes=seeds, timeout=2.0)
    store = await RemoteStore.open(cfg, "ns-cluster", slabs, metrics())
    try:
        keys = key_rows("cl", 30)
        fill(slabs, range(30), keys)
        assert (await store.put(keys, np.arange(30))).all()
        assert all(int(n.cli("dbsize")) > 0 for n in redis_cluster)  # keys spread over all three masters
        assert (await store.exists(np.concatenate([keys, key_rows("none", 2)]))).tolist() == [True] * 30 + [False] * 2
        slabs.slab_np[30:60] = 0
        ok = await store.get(keys, np.arange(30, 60))
        assert ok.all()
        for i in range(30):
            assert np.array_equal(slabs.slab_np[30 + i], block_bytes(keys[i].tobytes()))
        assert not store.degraded and pool_in_use(store) == 0
    finally:
        await store.aclose()
