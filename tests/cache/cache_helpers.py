"""Small real caches over real CPU tensors (the 'GPU' regions live on the CPU here)."""

from __future__ import annotations

import torch

import tiered_kv as tkv

BLOCK = 1024  # bytes per block, split over two regions


def make_kv(num_blocks: int = 64, device: str = "cpu"):
    k = torch.zeros(num_blocks, 768, dtype=torch.uint8, device=device)
    v = torch.zeros(num_blocks, 256, dtype=torch.uint8, device=device)
    return {"k": k, "v": v}


def fill(kv, gpu_id: int, key: bytes) -> None:
    """Write bytes derived from the key into a GPU block."""
    for t in kv.values():
        t[gpu_id] = block_bytes(key, t.shape[1]).to(t.device)


def block_bytes(key: bytes, n: int) -> torch.Tensor:
    reps = -(-n // len(key))
    return torch.frombuffer(bytearray((key * reps)[:n]), dtype=torch.uint8)


def holds(kv, gpu_id: int, key: bytes) -> bool:
    return all(torch.equal(t[gpu_id].cpu(), block_bytes(key, t.shape[1])) for t in kv.values())


def config(tmp_path=None, *, cpu_blocks=16, disk_blocks=0, policy="lru", spill="write_back", inflight=None, num_blocks=64):
    cfg = {
        "model": {"model_id": "test-model", "bytes_per_block": BLOCK},
        "gpu": {"num_blocks": num_blocks},
        "tiers": {"cpu": {"capacity": cpu_blocks * BLOCK, "pin_memory": "auto"}, "disk": {"enabled": False}},
        "eviction": {"policy": policy},
        "transfer": {"engine": "auto"},
    }
    if inflight:
        cfg["transfer"]["max_inflight_bytes"] = inflight
    if disk_blocks:
        cfg["tiers"]["disk"] = {
            "enabled": True,
            "path": str(tmp_path / "disk"),
            "capacity": disk_blocks * BLOCK,
            "spill_policy": spill,
        }
    return cfg


def cache_for(kv, cfg):
    layout = tkv.KVLayout.from_tensors(kv, next(iter(kv.values())).shape[0])
    return tkv.TieredKVCache(cfg, layout)
