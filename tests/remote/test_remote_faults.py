"""Server faults against a real redis-server: SIGKILL mid-put and mid-get, restart on the same port,
SIGSTOP past the timeout, out of memory. Never an exception, never wrong bytes, degraded then recovered."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from redis_helpers import NO_REDIS, REDIS, RedisServer, key_rows, metrics, pool_in_use, remote_cfg

import tiered_kv as tkv
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.tiers.remote import RemoteStore

BIG = 256 << 10
N = 64  # a batch of 16 MiB: long enough on loopback to be cut in the middle


@pytest.fixture
def big_slabs():
    s = CpuSlabs(tkv.KVLayout.from_block_bytes([BIG], num_blocks=4), 2 * N + 8, pin="off")
    yield s
    s.release()


def expected(key: np.ndarray) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8].tobytes(), "little")).integers(0, 256, BIG, dtype=np.uint8)


def fill_big(slabs, keys) -> None:
    for i, k in enumerate(keys):
        slabs.slab_np[i] = expected(k)


def assert_no_wrong_bytes(slabs, keys, ok, first_row) -> None:
    for i in np.flatnonzero(ok):
        assert np.array_equal(slabs.slab_np[first_row + i], expected(keys[i])), f"wrong bytes in block {i}"


async def wait_recovered(store, limit: float = 15.0) -> float:
    t0 = time.monotonic()
    while store.degraded:
        assert time.monotonic() - t0 < limit, f"not recovered after {limit} s: {store.degraded_reason}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def round_trip_ok(store, slabs, keys) -> None:
    fill_big(slabs, keys)
    assert (await store.put(keys, np.arange(len(keys)))).all()
    slabs.slab_np[N : N + len(keys)] = 0
    ok = await store.get(keys, np.arange(N, N + len(keys)))
    assert ok.all()
    assert_no_wrong_bytes(slabs, keys, ok, N)


@pytest.mark.slow
async def test_sigkill_mid_put_then_restart(redis_server, big_slabs, caplog):
    m = metrics()
    store = await RemoteStore.open(remote_cfg(redis_server.url), "ns-f", big_slabs, m)
    try:
        keys = key_rows("kill-put", N)
        fill_big(big_slabs, keys)
        task = asyncio.create_task(store.put(keys, np.arange(N)))
        await asyncio.sleep(0)  # the batch is on the socket
        redis_server.kill()
        ok = await task  # no exception
        assert not ok.all() and store.degraded
        assert m.snapshot()["tiered_kv_degraded_events_total{remote}"] == 1
        assert sum("degraded" in r.message for r in caplog.records if r.levelname == "WARNING") == 1
        t0 = time.monotonic()  # while down: every call answers False at once, without the network
        assert not (await store.get(keys, np.arange(N, 2 * N))).any()
        assert not (await store.exists(keys)).any()
        assert time.monotonic() - t0 < 0.1
        redis_server.start()  # same port, empty (no persistence)
        await wait_recovered(store)
        assert not (await store.get(keys[:4], np.arange(N, N + 4))).any()  # the restart lost them: misses
        await round_trip_ok(store, big_slabs, keys[:16])
        assert pool_in_use(store) == 0
    finally:
        await store.aclose()


@pytest.mark.slow
async def test_sigkill_mid_get_never_lands_wrong_bytes(redis_server, big_slabs):
    m = metrics()
    store = await RemoteStore.open(remote_cfg(redis_server.url), "ns-f", big_slabs, m)
    try:
        keys = key_rows("kill-get", N)
        fill_big(big_slabs, keys)
        assert (await store.put(keys, np.arange(N))).all()
        big_slabs.slab_np[N : 2 * N] = 0
        task = asyncio.create_task(store.get(keys, np.arange(N, 2 * N)))
        t0 = time.monotonic()
        while not big_slabs.slab_np[N].any() and not task.done() and time.monotonic() - t0 < 5:
            await asyncio.sleep(0)  # until the first replies have landed
        redis_server.kill()
        ok = await task
        assert not ok.all() and store.degraded
        assert_no_wrong_bytes(big_slabs, keys, ok, N)
        redis_server.start()
        await wait_recovered(store)
        await round_trip_ok(store, big_slabs, keys[:16])
    finally:
        await store.aclose()


@pytest.mark.slow
async def test_sigstop_past_the_timeout_then_sigcont(redis_server, big_slabs):
    m = metrics()
    timeout = 0.3
    store = await RemoteStore.open(remote_cfg(redis_server.url, timeout=timeout), "ns-f", big_slabs, m)
    try:
        keys = key_rows("stop", 8)
        fill_big(big_slabs, keys)
        assert (await store.put(keys, np.arange(8))).all()
        redis_server.pause()
        try:
            t0 = time.monotonic()
            ok = await store.get(keys, np.arange(N, N + 8))
            waited = time.monotonic() - t0
            assert not ok.any() and store.degraded
            assert timeout * 0.9 < waited < timeout * 4, waited  # bounded by the timeout, not hung
            t0 = time.monotonic()  # degraded: not consulted, so no second wait on the paused server
            assert not (await store.put(keys, np.arange(8))).any()
            assert not (await store.get(keys, np.arange(N, N + 8))).any()
            assert time.monotonic() - t0 < timeout / 2
            await asyncio.sleep(3 * timeout)  # reconnect probes time out against the paused server
            assert store.degraded
        finally:
            redis_server.resume()
        await wait_recovered(store)
        big_slabs.slab_np[N : N + 8] = 0
        ok = await store.get(keys, np.arange(N, N + 8))
        assert ok.all()  # the same server, its data intact
        assert_no_wrong_bytes(big_slabs, keys, ok, N)
        assert m.snapshot()["tiered_kv_degraded_events_total{remote}"] == 1
    finally:
        await store.aclose()


@pytest.mark.slow
async def test_out_of_memory_degrades_until_redis_has_room(tmp_path, big_slabs):
    if REDIS is None:
        pytest.skip(NO_REDIS)
    server = RedisServer(tmp_path / "oom", extra=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")).start()
    store = None
    try:
        store = await RemoteStore.open(remote_cfg(server.url), "ns-f", big_slabs, metrics())
        keys = key_rows("oom", 32)
        fill_big(big_slabs, keys)
        ok = await store.put(keys, np.arange(32))  # 8 MiB into 4 MiB: the later SETs answer OOM
        assert 0 < np.count_nonzero(ok) < 32 and store.degraded and "out of memory" in store.degraded_reason
        server.cli("flushall")
        server.cli("config", "set", "maxmemory", "0")
        await wait_recovered(store)
        await round_trip_ok(store, big_slabs, keys[:16])
    finally:
        if store is not None:
            await store.aclose()
        server.kill()
