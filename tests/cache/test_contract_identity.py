"""What a block means: geometry agreed with the config, keys validated, namespaces per layout, shard, revision."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import tiered_kv as tkv
from tiered_kv.capacity import plan

NB = 12
SHAPE = (NB, 16, 2, 8)  # [blocks, block_tokens, kv_heads, head_dim]


def kv_pair(dtype=torch.float16, order=("k", "v")):
    return {name: torch.zeros(SHAPE, dtype=dtype) for name in order}


def model_cfg(**model) -> dict:
    if not {"bytes_per_block", "num_layers"} & set(model):
        model["bytes_per_block"] = 1024  # the float16 pair below
    return {
        "model": {"model_id": "identity-test", **model},
        "gpu": {"num_blocks": NB},
        "tiers": {"cpu": {"capacity": "64KiB"}, "disk": {"enabled": False}},
    }


def shape_cfg(**over) -> dict:
    geo = {"dtype": "float16", "block_tokens": 16, "num_layers": 1, "num_kv_heads": 2, "head_dim": 8}
    return model_cfg(**{**geo, **over})


def with_disk(cfg: dict, path) -> dict:
    cfg["tiers"]["disk"] = {"enabled": True, "path": str(path), "capacity": "256KiB", "spill_policy": "write_through"}
    return cfg


def pattern(key: bytes, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray((key * (n // len(key) + 1))[:n]), dtype=torch.uint8)


def fill(kv, gid: int, key: bytes) -> None:
    for t in kv.values():
        row = t[gid].view(-1).view(torch.uint8)
        row.copy_(pattern(key, row.numel()))


# -- item 4: one bytes_per_block, checked where the cache is built ----------------------------
def test_config_geometry_must_match_the_layout():
    layout = tkv.KVLayout.from_tensors(kv_pair(torch.float32), NB, block_tokens=16)
    with pytest.raises(tkv.ConfigError, match="model.dtype: the config says float16 but the KV tensors are float32"):
        tkv.TieredKVCache(model_cfg(bytes_per_block=layout.bytes_per_block, dtype="float16"), layout)
    with pytest.raises(tkv.ConfigError, match="model.block_tokens: the config says 32 but the layout has 16"):
        tkv.TieredKVCache(model_cfg(bytes_per_block=layout.bytes_per_block, block_tokens=32), layout)
    with pytest.raises(tkv.ConfigError, match="gives bytes_per_block = 1024 but the KV tensors give 2048"):
        tkv.TieredKVCache(shape_cfg(), layout)  # float16 geometry against float32 tensors
    cfg = model_cfg(bytes_per_block=layout.bytes_per_block)
    cfg["gpu"]["num_blocks"] = 1024
    with pytest.raises(tkv.ConfigError, match="gpu.num_blocks: the config says 1024 but the KV tensors hold 12"):
        tkv.TieredKVCache(cfg, layout)


def test_geometry_the_config_leaves_out_comes_from_the_layout():
    layout = tkv.KVLayout.from_tensors(kv_pair(torch.bfloat16), NB, block_tokens=16)
    cache = tkv.TieredKVCache({"tiers": {"cpu": {"capacity": "1MiB"}}}, layout)  # no model section
    ns = cache.keyer.namespace
    assert (ns.dtype, ns.block_tokens) == ("bfloat16", 16)
    matching = tkv.TieredKVCache(shape_cfg(dtype="bfloat16"), layout)  # stated and equal: accepted
    assert (matching.keyer.namespace.dtype, matching.keyer.namespace.block_tokens) == ("bfloat16", 16)


def test_plan_and_the_cache_count_the_same_slots():
    cfg = tkv.load_config(shape_cfg())
    layout = tkv.KVLayout.from_tensors(kv_pair(), NB, block_tokens=16)
    cache = tkv.TieredKVCache(cfg, layout)
    planned = {t["tier"]: t["slots"] for t in plan(cfg)["tiers"]}
    assert planned == {"gpu": NB, "cpu": cache.manager.cpu.num_slots}
    assert {t["tier"]: t["slots"] for t in plan(cfg, layout)["tiers"]} == planned


# -- item 5: bad keys and ids fail at the call -------------------------------------------------
async def test_bad_keys_and_ids_fail_at_the_call_and_leak_nothing():
    kv = kv_pair()
    layout = tkv.KVLayout.from_tensors(kv, NB)
    async with tkv.TieredKVCache(model_cfg(), layout) as cache:
        good = cache.keyer.keys_for_tokens(list(range(32)))
        bad_keys = [[None], ["x" * 32], [b"short"], [bytearray(32)], b"x" * 32, [good[0], good[0][:16]]]
        for keys in bad_keys:
            ids = list(range(len(keys))) if isinstance(keys, list) else [0]
            for call in (cache.store, cache.load):
                with pytest.raises(tkv.KeyFormatError):
                    await call(keys, ids)
            with pytest.raises(tkv.KeyFormatError):
                cache.touch(keys)
        with pytest.raises(tkv.KeyFormatError, match=r"keys\[0\] is a str"):
            cache.lookup(["x" * 32])
        with pytest.raises(tkv.KeyFormatError, match=r"keys\[0\] is 5 bytes, expected 32"):
            cache.lookup([b"short"])
        for ids, why in (([True], "bool"), (["3"], "not an int"), ([None], "not an int"), ([1.0], "not an int"),
                         ([NB], "out of range"), ([-1], "out of range")):  # fmt: skip
            with pytest.raises(tkv.BlockIdError, match=why):
                await cache.store(good[:1], ids)
        cache.check_invariants()
        assert cache.manager.cpu.used == 0  # nothing reserved by a refused call
        fill(kv, 0, good[0])
        assert (await cache.store(good[:1], np.array([0]))).stored == 1  # numpy ints are ints
        assert await cache.load(good[:1], torch.tensor([5])) == 1


# -- item 3: the layout digest identifies the layout, across restarts --------------------------
async def test_restart_with_reordered_or_renamed_tensors_never_reads_the_old_blocks(tmp_path):
    kv = kv_pair()
    layout = tkv.KVLayout.from_tensors(kv, NB)
    cfg = with_disk(model_cfg(), tmp_path / "disk")
    async with tkv.TieredKVCache(cfg, layout) as cache:
        keys = cache.keyer.keys_for_tokens(list(range(64)))
        for i, k in enumerate(keys):
            fill(kv, i, k)
        await cache.store(keys, list(range(4)))
    for other in ({"v": kv["v"], "k": kv["k"]}, {"key": kv["k"], "v": kv["v"]}):
        relayout = tkv.KVLayout.from_tensors(other, NB)
        async with tkv.TieredKVCache(cfg, relayout) as cache:
            assert cache.recovered_blocks == 0
            assert cache.lookup(cache.keyer.keys_for_tokens(list(range(64)))).total == 0
            assert cache.lookup(keys).total == 0
    async with tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv, NB)) as cache:  # the same layout: hits
        assert cache.recovered_blocks == 4 and cache.lookup(keys).disk == 4


# -- item 6: namespaces real deployments need ---------------------------------------------------
async def test_tensor_parallel_ranks_never_serve_each_others_shards(tmp_path):
    cfg = with_disk(model_cfg(), tmp_path / "disk")
    tokens = list(range(64))
    keys_by_rank = {}
    for rank in (0, 1):
        kv = kv_pair()
        async with tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv, NB), rank=rank, world_size=2) as cache:
            keys = cache.keyer.keys_for_tokens(tokens)
            keys_by_rank[rank] = keys
            assert cache.lookup(keys).total == 0, f"rank {rank} sees blocks another rank wrote"
            for i, k in enumerate(keys):
                fill(kv, i, k)
            await cache.store(keys, list(range(4)))
    assert keys_by_rank[0] != keys_by_rank[1]
    dirs = sorted(p.name for p in (tmp_path / "disk").iterdir() if p.name.startswith("ns-"))
    assert len(dirs) == 2
    with pytest.raises(tkv.ConfigError, match="rank must be in"):
        tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv_pair(), NB), rank=2, world_size=2)


def test_revision_and_model_change_the_keys():
    layout = tkv.KVLayout.from_tensors(kv_pair(), NB)
    keys = {}
    for name, model in {"a": {}, "rev": {"revision": "sha-2"}, "model": {"model_id": "other"}}.items():
        cfg = model_cfg(**model)
        keys[name] = tkv.make_keyer(tkv.load_config(cfg), layout).keys_for_tokens(list(range(16)))
    assert len({k[0] for k in keys.values()}) == 3


def test_a_scheduler_process_without_tensors_builds_the_workers_keys(tmp_path):
    """The worker publishes layout.spec(); another process builds the keyer from it and the config."""
    cfg = shape_cfg()
    worker_layout = tkv.KVLayout.from_tensors(kv_pair(), NB, block_tokens=16)
    worker = tkv.TieredKVCache(cfg, worker_layout, rank=1, world_size=2)
    tokens = list(range(80))
    script = (
        "import json, sys, tiered_kv as tkv\n"
        "doc = json.load(sys.stdin)\n"
        "layout = tkv.KVLayout.from_spec(doc['layout'])\n"
        "keyer = tkv.make_keyer(tkv.load_config(doc['config']), layout, rank=1, world_size=2)\n"
        "print(json.dumps([k.hex() for k in keyer.keys_for_tokens(doc['tokens'])]))\n"
    )
    doc = {"layout": worker_layout.spec(), "config": cfg, "tokens": tokens}
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps(doc), capture_output=True, text=True,
                         timeout=120, env={"PYTHONHASHSEED": "random", "PATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [k.hex() for k in worker.keyer.keys_for_tokens(tokens)]


def test_upstream_64_bit_hash_ids_work():
    keyer = tkv.make_keyer(tkv.load_config(model_cfg()), tkv.KVLayout.from_tensors(kv_pair(), NB))
    big = keyer.keys_for_block_ids([2**63, 2**64 - 1, 5])
    assert len(big) == 3 and keyer.keys_for_block_ids([-1]) == keyer.keys_for_block_ids([2**64 - 1])
    with pytest.raises(tkv.KeyFormatError, match="64 bits"):
        keyer.keys_for_block_ids([2**64])
    with pytest.raises(tkv.KeyFormatError, match="must be an int"):
        keyer.keys_for_block_ids([True])
