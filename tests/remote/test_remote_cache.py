"""The remote tier inside TieredKVCache, against a real redis-server: two processes share a prefix,
bad values are misses, and a dead server never stops the cache serving from its own tiers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_proc import cache_config, make_kv, pattern

import tiered_kv as tkv
from tiered_kv.tiers.remote.format import redis_keys

HERE = Path(__file__).parent


def holds(kv, gid: int, key: bytes) -> bool:
    return all(torch.equal(t[gid], pattern(key, t.shape[1])) for t in kv.values())


def open_cache(url: str, kv=None):
    kv = kv if kv is not None else make_kv()
    return kv, tkv.TieredKVCache(cache_config(url), tkv.KVLayout.from_tensors(kv, 64))


def store_in_other_process(url: str, n: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, str(HERE / "cache_proc.py"), url, str(n)], capture_output=True,
                         text=True, timeout=120, cwd=HERE)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    stored, landed = map(int, out.stdout.split())
    return stored, landed


async def test_a_prefix_stored_by_one_process_loads_byte_exact_in_another(redis_server):
    assert store_in_other_process(redis_server.url, 6) == (6, 6)
    kv, cache = open_cache(redis_server.url)
    async with cache:
        keys = cache.keyer.keys_for_block_ids(range(8))
        assert cache.lookup(keys).total == 0  # never waits on the network: unknown until probed
        hit = await cache.probe(keys)
        assert (hit.total, hit.remote, hit.cpu) == (6, 6, 0)
        assert await cache.load(keys[:6], list(range(10, 16))) == 6
        assert all(holds(kv, 10 + i, keys[i]) for i in range(6))
        assert cache.lookup(keys).cpu == 6  # promoted into this instance's CPU tier
        assert cache.stats()["metrics"]["tiered_kv_hit_blocks_total{remote}"] == 6


async def test_bad_values_in_redis_are_misses_never_data(redis_server):
    assert store_in_other_process(redis_server.url, 4) == (4, 4)
    kv, cache = open_cache(redis_server.url)
    async with cache:
        keys = cache.keyer.keys_for_block_ids(range(4))
        rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(4, -1)
        rkeys = redis_keys((cache.config.tiers.remote.key_prefix + cache.remote.store.namespace + ":").encode(), rows)
        value = redis_server.raw(b"GET", rkeys[2])
        redis_server.raw(b"SET", rkeys[2], value[:-1] + bytes([value[-1] ^ 1]))  # one flipped bit in block 2
        assert (await cache.probe(keys)).remote == 4
        assert await cache.load(keys, list(range(20, 24))) == 2  # stops at the bad block: a miss
        assert holds(kv, 20, keys[0]) and holds(kv, 21, keys[1]) and not holds(kv, 22, keys[2])
        assert cache.lookup(keys).total == 2  # the bad block is forgotten, not offered again
        cache.check_invariants()


async def test_a_dead_server_degrades_the_tier_and_the_cache_keeps_serving(redis_server):
    kv, cache = open_cache(redis_server.url)
    async with cache:
        keys = cache.keyer.keys_for_block_ids(range(4))
        for i, key in enumerate(keys):
            for t in kv.values():
                t[i] = pattern(key, t.shape[1])
        assert (await cache.store(keys, [0, 1, 2, 3])).stored == 4
        redis_server.kill()
        more = cache.keyer.keys_for_block_ids(range(100, 104))
        assert (await cache.probe(more)).total == 0  # answers, no exception
        assert await cache.load(keys, [30, 31, 32, 33]) == 4  # the CPU tier still serves
        assert all(holds(kv, 30 + i, keys[i]) for i in range(4))
        assert (await cache.store(more, [4, 5, 6, 7])).stored == 4
        assert cache.stats()["remote"]["degraded"]


async def test_a_block_gone_from_redis_is_a_miss_at_load_time(redis_server):
    assert store_in_other_process(redis_server.url, 3) == (3, 3)
    kv, cache = open_cache(redis_server.url)
    async with cache:
        keys = cache.keyer.keys_for_block_ids(range(3))
        assert (await cache.probe(keys)).remote == 3
        redis_server.cli("flushall")  # evicted by Redis (or another instance) after the probe
        assert cache.lookup(keys).remote == 3  # still believed present: lookup never asks the network
        assert await cache.load(keys, [20, 21, 22]) == 0  # a miss, not an error
        assert cache.lookup(keys).total == 0  # and forgotten
        cache.check_invariants()


async def test_an_unreachable_server_fails_start_naming_the_url_without_its_password(monkeypatch):
    from redis_helpers import free_port

    monkeypatch.setenv("TKV_TEST_REDIS_PASSWORD", "s3cret")
    cfg = cache_config(f"redis://127.0.0.1:{free_port()}/0")
    cfg["tiers"]["remote"]["password_env"] = "TKV_TEST_REDIS_PASSWORD"
    cfg["tiers"]["remote"]["timeout"] = 0.5
    kv = make_kv()
    cache = tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv, 64))
    with pytest.raises(tkv.RemoteError, match="127.0.0.1") as err:
        await cache.start()
    assert "s3cret" not in str(err.value)


async def test_write_back_sends_a_block_to_redis_only_when_the_cpu_evicts_it(redis_server):
    cfg = cache_config(redis_server.url)
    cfg["tiers"]["cpu"]["capacity"] = 4 * 1024
    cfg["tiers"]["remote"]["write"] = "write_back"
    kv = make_kv()
    async with tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv, 64)) as cache:
        keys = cache.keyer.keys_for_block_ids(range(6))
        for i, key in enumerate(keys):
            for t in kv.values():
                t[i] = pattern(key, t.shape[1])
        await cache.store(keys[:4], [0, 1, 2, 3])
        rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(6, -1)
        assert not cache.remote.residency.known(rows).any()  # nothing evicted yet: nothing written
        await cache.store(keys[4:], [4, 5])  # evicts two: written to Redis before their slots are reused
        assert int(cache.remote.residency.known(rows).sum()) == 2
        gone = [k for k in keys[:4] if cache.tiers_of([k]) == ["remote"]]
        assert len(gone) == 2
        assert await cache.load(gone, [40, 41]) == 2
        assert holds(kv, 40, gone[0]) and holds(kv, 41, gone[1])


async def test_reset_empties_the_remote_namespace_and_only_it(redis_server):
    assert store_in_other_process(redis_server.url, 6) == (6, 6)
    redis_server.raw(b"SET", b"someone-else:key", b"kept")  # another namespace's key survives
    kv, cache = open_cache(redis_server.url)
    async with cache:
        keys = cache.keyer.keys_for_block_ids(range(6))
        assert (await cache.probe(keys)).remote == 6
        assert await cache.reset() is True
        assert cache.lookup(keys).total == 0
        assert (await cache.probe(keys)).total == 0  # gone from Redis, not only from the filter
    assert b"kept" in redis_server.raw(b"GET", b"someone-else:key")
    kv2, other = open_cache(redis_server.url)  # another instance of the namespace finds nothing either
    async with other:
        assert (await other.probe(keys)).total == 0
