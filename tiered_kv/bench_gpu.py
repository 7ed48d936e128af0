"""GPU section of `tiered-kv bench` (runs only where CUDA is available).

Raw: one contiguous ``copy_(non_blocking=True)`` of the same bytes between a
device tensor and page-locked host memory (what cudaMemcpyAsync peaks at).
Ours: the CUDAStreamEngine with scattered GPU block ids, as a serving engine
hands them out. Both timed with CUDA events / synchronize in the same run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch


def _pinned(nbytes: int) -> torch.Tensor:
    host = torch.empty(nbytes, dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {int(err)}")
    return host


def bench_gpu(block_sizes: Sequence[int] = (16 << 10, 256 << 10, 2 << 20), batch: int = 64,
              repeats: int = 20) -> list[dict]:
    if not torch.cuda.is_available():
        return []
    return asyncio.run(_bench(tuple(block_sizes), batch, repeats))


def _raw(gpu: torch.Tensor, cpu: torch.Tensor, batch: int, repeats: int, direction: str) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(repeats):
        g, c = gpu[i * batch : (i + 1) * batch], cpu[i * batch : (i + 1) * batch]
        if direction == "d2h":
            c.copy_(g, non_blocking=True)
        else:
            g.copy_(c, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


async def _bench(block_sizes: tuple[int, ...], batch: int, repeats: int) -> list[dict]:
    from .transfer.cuda import CUDAStreamEngine

    out = []
    for block_bytes in block_sizes:
        rows = max(repeats * batch, (256 << 20) // block_bytes)
        gpu = torch.randint(0, 256, (rows, block_bytes), dtype=torch.uint8, device="cuda")
        host_flat = _pinned(rows * block_bytes)
        try:
            cpu = host_flat.view(rows, block_bytes)
            chunk = batch * block_bytes
            nbytes = repeats * chunk

            perm = torch.randperm(rows).tolist()
            engine = CUDAStreamEngine([gpu], [cpu])
            try:
                for direction in ("d2h", "h2d"):
                    _raw(gpu, cpu, batch, repeats, direction)  # warm-up
                    raw_s = min(_raw(gpu, cpu, batch, repeats, direction) for _ in range(3))
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        handles = []
                        for i in range(repeats):
                            ids = perm[i * batch : (i + 1) * batch]
                            slots = list(range(i * batch, (i + 1) * batch))
                            handles.append(
                                engine.submit_store(ids, slots) if direction == "d2h" else engine.submit_load(slots, ids)
                            )
                        for h in handles:
                            await h
                        best = min(best, time.perf_counter() - t0)
                    out.append({
                        "direction": direction, "block_bytes": block_bytes, "batch": batch,
                        "raw_gbps": nbytes / raw_s / 1e9, "engine_gbps": nbytes / best / 1e9, "ratio": raw_s / best,
                    })  # fmt: skip
            finally:
                await engine.aclose()
        finally:
            torch.cuda.cudart().cudaHostUnregister(host_flat.data_ptr())
            torch.cuda.empty_cache()
    return out
