#!/usr/bin/env python3
"""Does copying KV slow the model? Compute alone vs beside continuous stores and loads, per copy path.

The compute runs on a stream of its own: bf16 GEMMs (8192^3) and a memory-bound loop (a 1 GiB in-place
multiply); the engine (2 MiB blocks in 64 regions, 64-block calls, scattered ids) stores and loads without
pause on its own streams. Each figure is the compute's time beside the copies over its time alone (CUDA
events on the compute stream, medians of 5), with the copies' GB/s meanwhile. Issue 38's target: <= 1.02.

    python scripts/gpu_compute_beside.py [--paths table table-direct groups] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, BLOCK, REGIONS, NB = 64, 2 << 20, 64, 1024


async def timed(stream: torch.cuda.Stream, work, reps: int = 5) -> float:
    """Median ms of ``work`` enqueued on ``stream``, polled without blocking the loop."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            work()
            end.record()
        while not end.query():
            await asyncio.sleep(0.0005)
        out.append(start.elapsed_time(end))
    return statistics.median(out)


async def one_path(path: str) -> dict:
    from tiered_kv.transfer import CUDAStreamEngine

    width = BLOCK // REGIONS
    gpu = [torch.zeros((NB, width), dtype=torch.uint8, device="cuda") for _ in range(REGIONS)]
    slab = torch.zeros((2 * BATCH, BLOCK), dtype=torch.uint8).pin_memory()
    cpu = list(torch.split(slab, [width] * REGIONS, dim=1))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    x = torch.ones(1 << 28, dtype=torch.float32, device="cuda")
    cs = torch.cuda.Stream()
    works = {"gemm": lambda: [a @ a for _ in range(10)], "membound": lambda: [x.mul_(1.0000001) for _ in range(50)]}
    rng = np.random.default_rng(0)
    out: dict = {"copy_path": path}
    async with CUDAStreamEngine(gpu, cpu, copy_path=path) as engine:
        out["copy_path"] = engine.copy_path
        for w in works.values():  # warm up
            await timed(cs, w, 1)
        alone = {k: await timed(cs, w) for k, w in works.items()}
        moved, stop = [0], asyncio.Event()

        async def copies() -> None:
            while not stop.is_set():
                # stores into the slab's first half, loads from its second: no slot is read and written at once
                g, s = rng.permutation(NB)[:BATCH], rng.permutation(BATCH)
                await asyncio.gather(engine.submit_store(g, s), engine.submit_load(BATCH + s, rng.permutation(NB)[:BATCH]))
                moved[0] += 2 * BATCH * BLOCK

        task = asyncio.create_task(copies())
        await asyncio.sleep(0.3)
        t0, m0 = time.perf_counter(), moved[0]
        beside = {k: await timed(cs, w) for k, w in works.items()}
        gbps = (moved[0] - m0) / (time.perf_counter() - t0) / 1e9
        stop.set()
        await task
    for k in works:
        out[f"{k}_alone_ms"] = round(alone[k], 2)
        out[f"{k}_beside_ms"] = round(beside[k], 2)
        out[f"{k}_slowdown"] = round(beside[k] / alone[k], 3)
    out["copies_gbps_meanwhile"] = round(gbps, 1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", nargs="+", default=["table", "table-direct", "groups"])
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_compute_beside: no CUDA found; nothing to measure")
        return 0
    rows = []
    for path in args.paths:
        rows.append(asyncio.run(one_path(path)))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
