"""GPU section: store (D2H) and load (H2D) through TieredKVCache with the CUDA engine vs raw pinned copies.

The cases and the method are the CPU section's (bench.copy), on a CUDA device:
engine region tensors in device memory, the CPU tier's slab page-locked, the
raw reference the fastest correct copy of the same bytes in the same layout
(gather the batch's rows on the device into a block-major staging buffer, then
one DMA into the run of slab rows; the reverse for loads). Beside it, the
peak of one plain pinned DMA of the batch's bytes, no gather: what the link
itself does.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..errors import TieredKVError
from .copy import BLOCK_SIZES, REGIONS, bench_copies
from .rig import BATCH


def cuda_available() -> bool:
    return torch.cuda.is_available()


def bench_gpu(block_sizes=BLOCK_SIZES, regions=REGIONS, **kw) -> dict:
    if not cuda_available():
        raise TieredKVError("bench --only gpu: needs CUDA, and torch.cuda.is_available() is False here")
    rows = bench_copies(block_sizes, regions, device="cuda", **kw)
    peaks = {b: _dma_peak(b) for b in block_sizes}
    for row in rows:
        row["pinned_dma_gbps"] = peaks[row["block_bytes"]]["d2h" if row["op"] == "store" else "h2d"]
    return {"device": torch.cuda.get_device_name(), "rows": rows}


def _dma_peak(block_bytes: int, tries: int = 9) -> dict[str, float]:
    return pinned_dma_gbps(BATCH * block_bytes, tries)


def pinned_dma_gbps(nbytes: int, tries: int = 9) -> dict[str, float]:
    """Median GB/s of one contiguous copy of ``nbytes`` between device memory and page-locked host memory
    (d2h, h2d): the yardstick every GPU ratio is taken against (the bench, scripts/gpu_e2e.py)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        runs = []
        for _ in range(tries + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        out[name] = round(nbytes / statistics.median(runs[1:]) / 1e9, 3)
    del dev, host
    torch.cuda.empty_cache()
    return out
