"""`tiered-kv disk ls|gc PATH` over namespaces written by a real cache."""

from __future__ import annotations

import json

import torch

import tiered_kv as tkv
from tiered_kv.cli import main


async def _write_blocks(path, model_id: str) -> None:
    kv = {"kv": torch.zeros(8, 512, dtype=torch.uint8)}
    cfg = {
        "model": {"bytes_per_block": 512, "model_id": model_id},
        "gpu": {"num_blocks": 8},
        "tiers": {
            "cpu": {"capacity": 4 * 512, "pin_memory": "off"},
            "disk": {"enabled": True, "path": str(path), "capacity": 16 * 512, "spill_policy": "write_through"},
        },
    }
    async with tkv.TieredKVCache(cfg, tkv.KVLayout.from_tensors(kv, 8)) as cache:
        await cache.store(cache.keyer.keys_for_block_ids(range(3)), [0, 1, 2])


async def test_disk_ls_and_gc(tmp_path, capsys):
    await _write_blocks(tmp_path, "model-a")
    await _write_blocks(tmp_path, "model-b")
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["model_id"] for r in rows) == ["model-a", "model-b"]
    assert all(r["blocks"] == 3 and r["bytes_per_block"] == 512 for r in rows)
    victim = next(r["dirname"] for r in rows if r["model_id"] == "model-a")
    assert main(["disk", "gc", str(tmp_path), victim, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [victim]
    assert main(["disk", "ls", str(tmp_path), "--json"]) == 0
    assert [r["model_id"] for r in json.loads(capsys.readouterr().out)] == ["model-b"]
    assert main(["disk", "gc", str(tmp_path), "ns-does-not-exist"]) == 2
    assert main(["disk", "ls", str(tmp_path / "missing")]) == 2
    (tmp_path / "not-ours").mkdir()
    assert main(["disk", "gc", str(tmp_path), "--all", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["removed"]) == 1
    assert (tmp_path / "not-ours").is_dir()  # never touches directories that are not namespaces
