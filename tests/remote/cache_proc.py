"""A second serving instance for test_remote_cache: stores a prefix through its own TieredKVCache
into a shared Redis, waits until the write-through landed, prints how many blocks it stored."""

from __future__ import annotations

import asyncio
import sys

import torch

import tiered_kv as tkv


def cache_config(url: str) -> dict:
    return {
        "model": {"model_id": "remote-test", "bytes_per_block": 1024},
        "gpu": {"num_blocks": 64},
        "tiers": {"cpu": {"capacity": 16 * 1024, "pin_memory": "off"}, "disk": {"enabled": False},
                  "remote": {"enabled": True, "url": url, "timeout": 2.0}},
        "transfer": {"engine": "host"},
    }


def make_kv() -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(64, 768, dtype=torch.uint8), "v": torch.zeros(64, 256, dtype=torch.uint8)}


def pattern(key: bytes, n: int) -> torch.Tensor:
    reps = -(-n // len(key))
    return torch.frombuffer(bytearray((key * reps)[:n]), dtype=torch.uint8)


async def main(url: str, n: int) -> None:
    kv = make_kv()
    layout = tkv.KVLayout.from_tensors(kv, 64)
    async with tkv.TieredKVCache(cache_config(url), layout) as cache:
        keys = cache.keyer.keys_for_block_ids(range(n))
        for i, key in enumerate(keys):
            for t in kv.values():
                t[i] = pattern(key, t.shape[1])
        res = await cache.store(keys, list(range(n)))
        rows = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).view(n, -1).numpy()
        for _ in range(500):  # write-through runs in the background: wait until Redis has every block
            if cache.remote.residency.known(rows).all():
                break
            await asyncio.sleep(0.01)
        print(res.stored, int(cache.remote.residency.known(rows).sum()), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
