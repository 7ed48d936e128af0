#!/usr/bin/env python3
"""End to end through TieredKVCache on a GPU, at three real geometries, for every copy path (issues 38, 46).

Geometries (2 MiB blocks: 16 tokens x 8 KV heads x 128 dims in bf16 = 32 KiB per layer's K or V):
* llama8b: Llama-3.1-8B, 32 layers, K and V in allocations of their own (64 storages, 64 regions);
* vllm032: vLLM 0.32's placement, every layer of the group cut from one backing allocation, as its
  ``KVCacheTensor`` describes it (one storage, 64 regions, region-major);
* packed: a block-outermost layout (BLHNC, cross-layer blocks): one region, each block one 2 MiB row,
  where ``auto`` takes the direct road (issue 46: batch descriptors, no kernel, no staging).
Per geometry and copy path (direct, table, table-direct, groups: ``TIERED_KV_COPY_PATH``; ``direct`` is
forced at the 32 KiB-region geometries too, for comparison): 64-block calls with
scattered GPU ids, stores of fresh keys (each evicts once the tier is full), loads of resident keys, and
stores beside loads at once, and 1, 2, 4 and 8 calls in flight (started together, disjoint GPU ids);
GB/s, and the ratio to one pinned DMA of the same bytes measured in the same run. After the timing, one stored and reloaded batch is checked byte for byte.

    python scripts/gpu_e2e.py --json OUT.json [--calls 12]

Without CUDA it writes {"dry_run": true, ...} and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS, TOKENS, HEADS, DIM = 32, 16, 8, 128
REGION = TOKENS * HEADS * DIM * 2  # bf16: 32 KiB
BLOCK = 2 * LAYERS * REGION  # 2 MiB
BATCH = 64
INFLIGHT = (1, 2, 4, 8)  # calls in flight at once (issue 46: latency at 1, throughput above)


def tensors(geometry: str, num_blocks: int) -> tuple[dict[str, torch.Tensor], int]:
    """The model's KV tensors and their block dim."""
    shape = (num_blocks, TOKENS, HEADS, DIM)
    if geometry == "packed":  # every layer's K and V of a block in one row: one region of 2 MiB rows
        return {"kv": torch.randn((num_blocks, 2 * LAYERS, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device="cuda")}, 0
    if geometry == "llama8b":
        out = {}
        for i in range(LAYERS):
            for kv in "kv":
                out[f"layers.{i}.{kv}"] = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        return out, 0
    per_layer = 2 * num_blocks * REGION
    backing = torch.randint(-128, 127, (LAYERS * per_layer,), dtype=torch.int8, device="cuda")
    out = {f"layers.{i}": backing[i * per_layer : (i + 1) * per_layer].view(torch.bfloat16).view(2, *shape)
           for i in range(LAYERS)}  # fmt: skip
    return out, 1


async def case(geometry: str, path: str, calls: int, num_blocks: int, cpu_calls: int) -> dict:
    from tiered_kv.bench.rig import cache_config, fresh_keys
    from tiered_kv.cache import TieredKVCache
    from tiered_kv.layout import KVLayout

    os.environ["TIERED_KV_COPY_PATH"] = path  # read once, when the cache builds its engine
    kv, block_dim = tensors(geometry, num_blocks)
    layout = KVLayout.from_tensors(kv, num_blocks, block_dim=block_dim)
    cfg = cache_config(layout.bytes_per_block, num_blocks, cpu_calls * BATCH, "cuda")
    rng = np.random.default_rng(0)
    regions = list(layout.regions)
    async with TieredKVCache(cfg, layout) as cache:
        chosen = cache.stats()["copy_path"]
        kb = cache.keyer.key_bytes
        ids = lambda: rng.permutation(num_blocks)[:BATCH].tolist()  # noqa: E731 - scattered GPU ids
        resident: list[list[bytes]] = []

        async def store() -> None:
            keys = fresh_keys(rng, BATCH, kb)
            res = await cache.store(keys, ids())
            if res.stored != BATCH:
                raise RuntimeError(f"a store of {BATCH} fresh keys placed {res.stored}")
            resident.append(keys)
            del resident[: -cpu_calls // 2]  # the newest half of the tier: never evicted before its load

        async def load() -> None:
            got = await cache.load(resident[int(rng.integers(len(resident)))], ids())
            if got != BATCH:
                raise RuntimeError(f"a load of resident keys returned {got}")

        for _ in range(cpu_calls + 2):  # fill the tier (and compile the kernels): every timed store evicts
            await store()
        await load()
        out = {"geometry": geometry, "copy_path": chosen, "regions": layout.num_regions,
               "storages": len({r.untyped_storage().data_ptr() for r in regions}), "block_bytes": layout.bytes_per_block}  # fmt: skip
        nbytes = BATCH * layout.bytes_per_block
        for name, fn, per in (("store", store, 1), ("load", load, 1), ("both", None, 2)):
            times = []
            for _ in range(calls):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if fn is None:  # a store and a load at once: PCIe is full duplex
                    await asyncio.gather(store(), load())
                else:
                    await fn()
                times.append(time.perf_counter() - t0)
            out[f"{name}_gbps"] = round(per * nbytes / statistics.median(times) / 1e9, 2)
        # Calls in flight (issue 46): N calls started together, disjoint GPU ids, GB/s over the N calls' bytes.
        for name in ("store", "load"):
            out[f"{name}_inflight_gbps"] = {}
            for n in INFLIGHT:
                times = []
                for _ in range(max(3, calls // 2)):
                    perm = rng.permutation(num_blocks)
                    sets = [perm[i * BATCH : (i + 1) * BATCH].tolist() for i in range(n)]
                    if name == "store":
                        keys = [fresh_keys(rng, BATCH, kb) for _ in range(n)]
                        calls_ = [cache.store(k, g) for k, g in zip(keys, sets, strict=True)]
                    else:
                        pick = [resident[-1 - (i % len(resident))] for i in range(n)]
                        calls_ = [cache.load(k, g) for k, g in zip(pick, sets, strict=True)]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    got = await asyncio.gather(*calls_)
                    times.append(time.perf_counter() - t0)
                    moved = [g.stored if name == "store" else g for g in got]
                    if moved != [BATCH] * n:
                        raise RuntimeError(f"{n} {name}s in flight moved {moved} blocks, expected {BATCH} each")
                    if name == "store":
                        resident.extend(keys)
                        del resident[: -cpu_calls // 2]
                out[f"{name}_inflight_gbps"][str(n)] = round(n * nbytes / statistics.median(times) / 1e9, 2)
        # Bytes: store a batch from scattered ids, load it into other scattered ids, compare every region.
        keys, a = fresh_keys(rng, BATCH, kb), ids()
        await cache.store(keys, a)
        b = [i for i in rng.permutation(num_blocks).tolist() if i not in set(a)][:BATCH]
        if await cache.load(keys, b) != BATCH:
            raise RuntimeError("the check load missed")
        torch.cuda.synchronize()
        ia, ib = torch.tensor(a, device="cuda"), torch.tensor(b, device="cuda")
        out["bytes_equal"] = all(torch.equal(r[ia], r[ib]) for r in regions)
    return out


async def host_us(path: str, n_regions: int, calls: int = 30) -> dict:
    """Host time on the loop thread per 64-block call (submit only, the copy runs on), 2 MiB blocks; also the
    round trip (submit to the future resolved) with one call in flight."""
    from tiered_kv.transfer import cuda_engine

    nb, width = 256, BLOCK // n_regions
    gpu = [torch.zeros((nb, width), dtype=torch.uint8, device="cuda") for _ in range(n_regions)]
    slab = torch.zeros((4 * BATCH, BLOCK), dtype=torch.uint8).pin_memory()  # 4 calls in flight, disjoint slots
    cpu = list(torch.split(slab, [width] * n_regions, dim=1))
    rng = np.random.default_rng(n_regions)
    out: dict = {"copy_path": path, "regions": n_regions}
    async with cuda_engine(gpu, cpu, copy_path=path) as engine:
        out["copy_path"] = engine.copy_path
        for name in ("store", "load"):
            times, trips = [], []
            for _ in range(calls + 2):
                g, s = rng.permutation(nb)[:BATCH], rng.permutation(2 * BATCH)[:BATCH]
                t0 = time.perf_counter()
                h = engine.submit_store(g, s) if name == "store" else engine.submit_load(s, g)
                times.append((time.perf_counter() - t0) * 1e6)
                await h
                trips.append((time.perf_counter() - t0) * 1e6)
            out[f"{name}_host_us"] = round(statistics.median(times[2:]), 1)
            out[f"{name}_round_trip_us"] = round(statistics.median(trips[2:]), 1)
            # The engine alone with 4 calls in flight (disjoint ids), per call: beside the cache's own rows
            # (bench --only gpu, inflight) this separates the engine's time per call from the cache's.
            per = []
            for _ in range(max(3, calls // 4)):
                g, s = rng.permutation(nb)[: 4 * BATCH], rng.permutation(4 * BATCH)
                parts = [(g[i * BATCH : (i + 1) * BATCH], s[i * BATCH : (i + 1) * BATCH]) for i in range(4)]
                t0 = time.perf_counter()
                hs = [engine.submit_store(a, b) if name == "store" else engine.submit_load(b, a) for a, b in parts]
                for h in hs:
                    await h
                per.append((time.perf_counter() - t0) * 1e6 / 4)
            out[f"{name}_x4_us_per_call"] = round(statistics.median(per), 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--num-blocks", type=int, default=768)
    p.add_argument("--paths", nargs="+", default=["direct", "table", "table-direct", "groups"])
    a = p.parse_args()
    if not torch.cuda.is_available():
        doc = {"dry_run": True, "cuda": False, "message": "no CUDA found: nothing was run"}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc))
        return 0
    from tiered_kv.bench.gpu import pinned_dma_gbps
    from tiered_kv.transfer.engines import table_kernel

    dma = pinned_dma_gbps(BATCH * BLOCK)
    doc = {"dry_run": False, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": table_kernel.available(), "batch_blocks": BATCH, "pinned_dma_gbps": dma, "cases": []}  # fmt: skip
    for geometry in ("llama8b", "vllm032", "packed"):
        for path in a.paths:
            if path not in ("groups", "direct") and not table_kernel.available():
                doc["cases"].append({"geometry": geometry, "copy_path": path, "skipped": "triton not importable"})
                continue
            try:
                row = asyncio.run(case(geometry, path, a.calls, a.num_blocks, 4 * max(INFLIGHT)))  # 8 in flight fit
            except Exception as exc:  # one path failing must not hide the others' figures
                row = {"geometry": geometry, "copy_path": path, "error": repr(exc)}
            if "store_gbps" in row:
                row["store_of_dma"] = round(row["store_gbps"] / dma["d2h"], 3)
                row["load_of_dma"] = round(row["load_gbps"] / dma["h2d"], 3)
                row["both_of_one_direction"] = round(row["both_gbps"] / max(row["store_gbps"], row["load_gbps"]), 3)
                for name, way in (("store", "d2h"), ("load", "h2d")):
                    row[f"{name}_inflight_of_dma"] = {n: round(g / dma[way], 3)
                                                      for n, g in row[f"{name}_inflight_gbps"].items()}  # fmt: skip
            doc["cases"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    doc["host_us_per_call"] = []
    for path in a.paths:
        for n_regions in (1, 8, 64, 128):  # 1: the packed layout (the direct road's own case)
            if path not in ("groups", "direct") and not table_kernel.available():
                continue
            try:
                row = asyncio.run(host_us(path, n_regions))
            except Exception as exc:
                row = {"copy_path": path, "regions": n_regions, "error": repr(exc)}
            doc["host_us_per_call"].append(row)
            print(json.dumps(row), flush=True)
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    bad = [c for c in doc["cases"] if "error" in c or c.get("bytes_equal") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
