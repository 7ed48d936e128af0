"""RemoteStore against a real redis-server on loopback: byte-exact batches, verification, setup errors."""

from __future__ import annotations

import numpy as np
import pytest
from redis_helpers import (
    BPB,
    RedisServer,
    block_bytes,
    count,
    fill,
    key_rows,
    metrics,
    pool_in_use,
    remote_cfg,
)

from tiered_kv.errors import ConfigError, RemoteError
from tiered_kv.manager import PromoteJob, SpillJob
from tiered_kv.tiers.remote import HEADER_SIZE, RemoteResidency, RemoteStore
from tiered_kv.tiers.remote.format import redis_keys
from tiered_kv.transfer.handlers.remote_io import RemoteIO

NS = "ns-test"


async def test_put_get_exists_byte_exact(redis_server, slabs):
    m = metrics()
    store = await RemoteStore.open(remote_cfg(redis_server.url, ttl=120), NS, slabs, m)
    try:
        keys = key_rows("a", 20)
        fill(slabs, range(20), keys)
        assert (await store.put(keys, np.arange(20))).all()
        assert (await store.exists(np.concatenate([keys, key_rows("absent", 3)]))).tolist() == [True] * 20 + [False] * 3
        slabs.slab_np[20:40] = 0
        order = np.random.default_rng(0).permutation(20)
        ok = await store.get(keys[order], np.arange(20, 40))
        assert ok.all()
        for j, i in enumerate(order):
            assert np.array_equal(slabs.slab_np[20 + j], block_bytes(keys[i].tobytes()))
        assert (count(m, "put", "stored"), count(m, "get", "hit"), count(m, "exists", "present")) == (20, 20, 20)
        assert m.snapshot()["tiered_kv_remote_bytes_total{get}"] == 20 * (HEADER_SIZE + BPB)
        rk = redis_keys(b"tkv:" + NS.encode() + b":", keys[:1])[0].decode()
        assert 0 < int(redis_server.cli("ttl", rk)) <= 120  # ttl applied
        assert not store.degraded and pool_in_use(store) == 0
    finally:
        await store.aclose()


async def test_missing_keys_are_misses_not_errors(redis_server, slabs):
    m = metrics()
    store = await RemoteStore.open(remote_cfg(redis_server.url), NS, slabs, m)
    try:
        keys = key_rows("b", 4)
        fill(slabs, range(2), keys[:2])
        assert (await store.put(keys[:2], np.arange(2))).all()
        assert (await store.get(keys, np.arange(10, 14))).tolist() == [True, True, False, False]
        assert (count(m, "get", "miss"), count(m, "get", "corrupt")) == (2, 0)
        assert not store.degraded
    finally:
        await store.aclose()


async def test_corrupt_values_are_counted_misses(redis_server, slabs):
    m = metrics()
    store = await RemoteStore.open(remote_cfg(redis_server.url), NS, slabs, m)
    other = await RemoteStore.open(remote_cfg(redis_server.url), "ns-other-layout", slabs, metrics())
    try:
        keys = key_rows("c", 6)
        fill(slabs, range(6), keys)
        assert (await store.put(keys, np.arange(6))).all()
        assert (await other.put(keys[5:6], np.arange(5, 6))).all()
        rk = redis_keys(b"tkv:" + NS.encode() + b":", keys)
        good = [redis_server.raw(b"GET", k).split(b"\r\n", 1)[1][:-2] for k in rk]
        assert len(good[0]) == HEADER_SIZE + BPB
        redis_server.raw(b"SET", rk[0], np.random.default_rng(1).bytes(HEADER_SIZE + BPB))  # garbage
        redis_server.raw(b"SET", rk[1], good[1][:-100])  # truncated
        redis_server.raw(b"SET", rk[2], good[3])  # another key's (valid) value under this key
        flipped = bytearray(good[4])
        flipped[HEADER_SIZE + 7] ^= 0x10
        redis_server.raw(b"SET", rk[4], bytes(flipped))  # one flipped payload bit
        other_rk = redis_keys(b"tkv:ns-other-layout:", keys[5:6])[0]
        other_val = redis_server.raw(b"GET", other_rk).split(b"\r\n", 1)[1][:-2]
        redis_server.raw(b"SET", rk[5], other_val)  # written by another namespace (layout/model)
        slabs.slab_np[30:36] = 7
        ok = await store.get(keys, np.arange(30, 36))
        assert ok.tolist() == [False, False, False, True, False, False]
        assert np.array_equal(slabs.slab_np[33], block_bytes(keys[3].tobytes()))
        for row in (30, 31, 32, 34, 35):  # nothing that failed verification was written into a slot
            assert (slabs.slab_np[row] == 7).all()
        assert count(m, "get", "corrupt") == 5
        assert m.snapshot()["tiered_kv_corrupt_blocks_total{remote}"] == 5
        redis_server.raw(b"DEL", rk[3])
        redis_server.raw(b"HSET", rk[3], b"f", b"v")  # a key of another type: a WRONGTYPE reply, a miss
        assert not (await store.get(keys[3:4], np.arange(40, 41))).any()
        assert not store.degraded
    finally:
        await store.aclose()
        await other.aclose()


async def test_remote_io_keeps_the_residency_filter(redis_server, slabs):
    m = metrics()
    store = await RemoteStore.open(remote_cfg(redis_server.url), NS, slabs, m)
    try:
        io, res = RemoteIO(store, RemoteResidency(1000), m), None
        res = io.residency
        keys = key_rows("io", 4)
        fill(slabs, range(4), keys)
        ok = await io.write(SpillJob(keys, np.arange(4), np.zeros(4, np.int64), reuse=False))
        assert ok.all() and res.known(keys).all()
        redis_server.cli("del", redis_keys(b"tkv:" + NS.encode() + b":", keys[1:2])[0].decode())
        job = PromoteJob(keys, np.zeros(4, np.int64), np.arange(10, 14), np.arange(4))
        assert (await io.read(job)).tolist() == [True, False, True, True]
        assert res.known(keys).tolist() == [True, False, True, True]  # found gone: forgotten
        fresh = RemoteIO(store, RemoteResidency(1000), m)
        assert (await fresh.probe(keys)).tolist() == [True, False, True, True]
        assert fresh.residency.known(keys).tolist() == [True, False, True, True]
    finally:
        await store.aclose()


async def test_unreachable_server_is_a_remote_error_without_password(slabs, monkeypatch):
    from redis_helpers import free_port

    monkeypatch.setenv("TKV_TEST_PW", "hunter2")
    cfg = remote_cfg(f"redis://127.0.0.1:{free_port()}/0", password_env="TKV_TEST_PW")
    with pytest.raises(RemoteError) as err:
        await RemoteStore.open(cfg, NS, slabs, metrics())
    assert f"127.0.0.1:{cfg.url.split(':')[2].split('/')[0]}" in str(err.value)
    assert "hunter2" not in str(err.value)


async def test_password_comes_from_the_environment(tmp_path, slabs, monkeypatch):
    from redis_helpers import NO_REDIS, REDIS

    if REDIS is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path / "pw", extra=("--requirepass", "s3cret-pw")).start()
    try:
        cfg = remote_cfg(server.url, password_env="TKV_TEST_PW")
        monkeypatch.delenv("TKV_TEST_PW", raising=False)
        with pytest.raises(ConfigError, match="TKV_TEST_PW is not set"):
            await RemoteStore.open(cfg, NS, slabs, metrics())
        monkeypatch.setenv("TKV_TEST_PW", "wrong")
        with pytest.raises(RemoteError) as err:
            await RemoteStore.open(cfg, NS, slabs, metrics())
        assert "wrong" not in str(err.value) and str(server.port) in str(err.value)
        monkeypatch.setenv("TKV_TEST_PW", "s3cret-pw")
        store = await RemoteStore.open(cfg, NS, slabs, metrics())
        keys = key_rows("pw", 2)
        fill(slabs, range(2), keys)
        assert (await store.put(keys, np.arange(2))).all()
        assert (await store.get(keys, np.arange(2, 4))).all()
        await store.aclose()
    finally:
        server.kill()
