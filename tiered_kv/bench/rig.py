"""A real TieredKVCache over synthetic engine tensors, sized for one bench case."""

from __future__ import annotations

import numpy as np
import torch

from ..cache import TieredKVCache
from ..layout import KVLayout

BATCH = 64  # blocks per store/load call in every copy and disk case
WORKING_SET = 64 << 20  # each tier spans at least this much, so no side runs from the CPU caches


def engine_tensors(block_bytes: int, regions: int, num_blocks: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    """One ``uint8[num_blocks, block_bytes // regions]`` tensor per region, every page written.

    Row i of region r is a random row pattern XOR a per-row byte, so a row or region
    copied to the wrong place does not compare equal (and filling costs one pass).
    """
    width = block_bytes // regions
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(regions):
        tile = torch.randint(0, 256, (1, width), dtype=torch.uint8, generator=gen)
        rows = ((torch.arange(num_blocks) * 131 + r * 17) % 251).to(torch.uint8)[:, None]
        out.append(torch.bitwise_xor(rows.to(device), tile.to(device)))
    return out


def cache_config(block_bytes: int, num_blocks: int, cpu_slots: int, device: str, *,
                 disk_dir: str | None = None, disk_slots: int = 0) -> dict:
    cuda = device == "cuda"
    cfg: dict = {
        "model": {"bytes_per_block": block_bytes, "model_id": "tiered-kv-bench"},
        "gpu": {"num_blocks": num_blocks},
        "tiers": {"cpu": {"capacity": cpu_slots * block_bytes, "pin_memory": "on" if cuda else "off"},
                  "disk": {"enabled": False}},
        "transfer": {"engine": "cuda" if cuda else "host",
                     # 8 calls in flight at once (bench.inflight), not held back by the byte budget
                     "max_inflight_bytes": max(256 << 20, 8 * BATCH * block_bytes)},
    }  # fmt: skip
    if disk_dir is not None:
        cfg["tiers"]["disk"] = {"enabled": True, "path": disk_dir, "capacity": disk_slots * block_bytes}
    return cfg


def open_cache(gpu: list[torch.Tensor], block_bytes: int, cpu_slots: int, device: str, *, engine_factory=None,
               **disk) -> TieredKVCache:  # fmt: skip
    """The cache (not started yet: ``async with`` it) over ``gpu``, one region per tensor; ``engine_factory``
    as TieredKVCache takes it (None: the engine the config names)."""
    num_blocks = int(gpu[0].shape[0])
    layout = KVLayout.from_tensors({f"region{r:03d}": t for r, t in enumerate(gpu)}, num_blocks, block_dim=0)
    return TieredKVCache(cache_config(block_bytes, num_blocks, cpu_slots, device, **disk), layout,
                         engine_factory=engine_factory)


def fresh_keys(rng: np.random.Generator, n: int, key_bytes: int) -> list[bytes]:
    """Keys never seen before (uniform bytes, as the keyer's hashes are)."""
    blob = rng.bytes(n * key_bytes)
    return [blob[i : i + key_bytes] for i in range(0, n * key_bytes, key_bytes)]


def random_ids(rng: np.random.Generator, num_blocks: int, n: int = BATCH) -> np.ndarray:
    """Distinct engine block ids in random order, as an engine's allocator hands them out."""
    return rng.permutation(num_blocks)[:n]
