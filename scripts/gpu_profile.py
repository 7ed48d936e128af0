#!/usr/bin/env python3
"""Where the host time of one 64-block copy call goes on a GPU (issue 38's 100 µs budget).

For each copy path, 2 MiB blocks in 64 regions: cProfile over 30 submits (Python-level, by own time),
then torch.profiler over 10 (CUDA runtime calls and torch ops, by self CPU time). Prints tables only.

    python scripts/gpu_profile.py [--paths table table-direct groups] [--regions 64]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, BLOCK = 64, 2 << 20


async def profile(path: str, n_regions: int) -> None:
    from tiered_kv.transfer import CUDAStreamEngine

    nb, width = 256, BLOCK // n_regions
    gpu = [torch.zeros((nb, width), dtype=torch.uint8, device="cuda") for _ in range(n_regions)]
    slab = torch.zeros((2 * BATCH, BLOCK), dtype=torch.uint8).pin_memory()
    cpu = list(torch.split(slab, [width] * n_regions, dim=1))
    rng = np.random.default_rng(0)
    async with CUDAStreamEngine(gpu, cpu, copy_path=path) as engine:
        def call() -> object:
            g, s = rng.permutation(nb)[:BATCH], rng.permutation(2 * BATCH)[:BATCH]
            return engine.submit_store(g, s)

        for _ in range(3):
            await call()
        prof = cProfile.Profile()
        for _ in range(30):
            prof.enable()
            h = call()
            prof.disable()
            await h
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"==== {path}, {n_regions} regions: cProfile of 30 submits (own time) ====")
        print(buf.getvalue()[-6000:])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            for _ in range(10):
                await call()
        print(f"==== {path}, {n_regions} regions: torch.profiler of 10 calls (self CPU) ====")
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", nargs="+", default=["table", "table-direct", "groups"])
    p.add_argument("--regions", type=int, default=64)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA found; nothing to profile")
        return 0
    for path in a.paths:
        asyncio.run(profile(path, a.regions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
