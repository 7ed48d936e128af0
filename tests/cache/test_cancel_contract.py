"""The engine's GPU blocks belong to the contract: no copy into or out of them outlives the call.

An engine frees and reuses its blocks the moment load/store returns or raises,
cancellation included; a late copy is silent wrong KV in another request.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
import torch

import tiered_kv as tkv

NB = 32
K_BYTES, V_BYTES = 384 * 1024, 128 * 1024  # 512 KiB blocks: batches go to the copy thread and race a cancel


def make_kv(device: str):
    return {
        "k": torch.zeros(NB, K_BYTES, dtype=torch.uint8, device=device),
        "v": torch.zeros(NB, V_BYTES, dtype=torch.uint8, device=device),
    }


def pattern(tag: bytes, n: int) -> torch.Tensor:
    seed = hashlib.sha256(tag).digest()
    return torch.frombuffer(bytearray((seed * (n // len(seed) + 1))[:n]), dtype=torch.uint8)


def write(kv, gid: int, tag: bytes) -> None:
    for t in kv.values():
        t[gid] = pattern(tag, t.shape[1]).to(t.device)


def holds(kv, gid: int, tag: bytes) -> bool:
    return all(torch.equal(t[gid].cpu(), pattern(tag, t.shape[1])) for t in kv.values())


def config(cpu_blocks: int, policy: str = "lru") -> dict:
    return {
        "model": {"model_id": "contract-test", "bytes_per_block": K_BYTES + V_BYTES},
        "gpu": {"num_blocks": NB},
        "tiers": {"cpu": {"capacity": cpu_blocks * (K_BYTES + V_BYTES)}, "disk": {"enabled": False}},
        "eviction": {"policy": policy},
    }


def key(i: int | str) -> bytes:
    return hashlib.sha256(f"key-{i}".encode()).digest()


async def _cancel_after(rng: random.Random, coro):
    task = asyncio.ensure_future(coro)
    for _ in range(rng.randrange(0, 4)):
        await asyncio.sleep(0)
    if rng.random() < 0.3:
        await asyncio.sleep(rng.random() * 2e-4)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


@pytest.mark.parametrize("policy", ["lru", "window"])  # window: exclusive loads leave ghosts behind
async def test_cancelled_loads_and_stores_never_touch_blocks_after_returning(device, policy):
    rng = random.Random(1234)
    kv = make_kv(device)
    layout = tkv.KVLayout.from_tensors(kv, NB)
    owner: dict[int, bytes] = {}  # GPU block -> tag of the bytes its last owner put there
    stored_keys: dict[bytes, bytes] = {}  # key -> tag its bytes were made from
    async with tkv.TieredKVCache(config(cpu_blocks=40, policy=policy), layout) as cache:
        pool = [key(f"pool{i}") for i in range(16)]
        for i, k in enumerate(pool):
            write(kv, i, k)
        await cache.store(pool, list(range(16)))
        stored_keys.update({k: k for k in pool})
        for gid in range(NB):
            owner[gid] = b"zero"
            write(kv, gid, b"zero")
        cancelled = 0
        for rnd in range(1000):
            ids = rng.sample(range(NB), 4)
            if rng.random() < 0.5:
                keys = rng.sample(pool, 4)
                for k in keys:
                    if k not in cache.manager.cpu.resident():  # evicted by the stores: put it back
                        write(kv, ids[0], k)
                        await cache.store([k], [ids[0]])
                        owner[ids[0]] = k
                # Half of them exclusive: staged, restaged, with the run held chunk by chunk.
                n = await _cancel_after(rng, cache.load(keys, ids, exclusive=rng.random() < 0.5))
                if n is None:
                    cancelled += 1
                else:
                    for gid, k in zip(ids[:n], keys[:n], strict=True):
                        owner[gid] = k
            else:
                keys = [key(f"r{rnd}-{j}") for j in range(4)]
                for gid, k in zip(ids, keys, strict=True):
                    write(kv, gid, k)
                    owner[gid] = k
                    stored_keys[k] = k
                res = await _cancel_after(rng, cache.store(keys, ids))
                cancelled += res is None
            # Returned or cancelled, the engine hands the blocks to the next request and writes them at once.
            for gid in ids:
                tag = f"fresh-{rnd}-{gid}".encode()
                write(kv, gid, tag)
                owner[gid] = tag
            if rnd % 50 == 0:
                await asyncio.sleep(0.002)
                bad = [g for g in ids if not holds(kv, g, owner[g])]
                assert not bad, f"round {rnd}: blocks {bad} were overwritten after the call returned"
        assert cancelled > 200
        await asyncio.sleep(0.01)
        bad = [g for g in range(NB) if not holds(kv, g, owner[g])]
        assert not bad, f"GPU blocks {bad} do not hold what their last owner wrote"
        # What the CPU tier holds for a key is that key's bytes or nothing.
        for k, slot in cache.manager.cpu.resident().items():
            for r, region in enumerate(cache.slabs.regions):
                want = pattern(stored_keys[k], region.shape[1])
                assert torch.equal(region[slot], want), f"CPU slot {slot} region {r} holds wrong bytes"
        cache.check_invariants()
        m = cache.manager
        assert (m.staging_in_use, m.cpu.n_ready_pinned, m.cpu.n_reserved, len(m.announced)) == (0, 0, 0, 0)


async def test_a_cancelled_load_waits_for_its_copy_before_raising(device):
    """Deterministic version: cancel while the copy is known to be in flight."""
    kv = make_kv(device)
    layout = tkv.KVLayout.from_tensors(kv, NB)
    async with tkv.TieredKVCache(config(cpu_blocks=NB), layout) as cache:
        keys = [key(i) for i in range(NB // 2)]
        for i, k in enumerate(keys):
            write(kv, i, k)
        await cache.store(keys, list(range(NB // 2)))
        engine = cache.engine
        for _ in range(20):
            task = asyncio.ensure_future(cache.load(keys, list(range(NB // 2, NB))))
            while engine.inflight == 0 and not task.done():
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.inflight == 0, "load raised CancelledError while its copy into the GPU blocks was running"


async def test_lifecycle_start_is_all_or_nothing_and_close_is_one_task(tmp_path, device):
    kv = make_kv(device)
    layout = tkv.KVLayout.from_tensors(kv, NB)
    cfg = config(cpu_blocks=4)
    cfg["tiers"]["disk"] = {"enabled": True, "path": str(tmp_path / "d"), "capacity": 8 * (K_BYTES + V_BYTES)}
    holder = tkv.TieredKVCache(cfg, layout)
    await holder.start()  # holds the disk namespace's lock
    cache = tkv.TieredKVCache(cfg, layout)
    with pytest.raises(tkv.CacheClosedError):
        cache.lookup([key(0)])  # before start
    with pytest.raises(tkv.TieredKVError):
        await cache.start()  # the disk tier cannot be opened: nothing may stay taken
    assert cache.slabs is None and cache.disk is None and (cache.engine is None or cache.engine.closed)
    await holder.aclose()
    await cache.start()  # the same cache retries and succeeds
    assert cache.lookup([key(0)]).total == 0
    closers = [asyncio.ensure_future(cache.aclose()) for _ in range(3)]
    closers[0].cancel()  # a cancelled closer does not cut the close in half
    await asyncio.gather(*closers[1:])
    assert cache.slabs is None and cache.lifecycle.state == "closed"
    with pytest.raises(tkv.CacheClosedError):
        await cache.start()
    with pytest.raises(tkv.CacheClosedError):
        cache.lookup([key(0)])
