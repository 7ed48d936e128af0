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
from .targets import TARGETS


def cuda_available() -> bool:
    return torch.cuda.is_available()


def bench_gpu(block_sizes=BLOCK_SIZES, regions=REGIONS, *, inflight: dict | None = None, **kw) -> dict:
    """The copy rows (one call in flight) and, unless ``inflight`` is None, the calls-in-flight rows (bench.inflight
    on CUDA at 16 KiB, 256 KiB and 2 MiB unless ``inflight`` names ``block_sizes``), each against the DMAs."""
    if not cuda_available():
        raise TieredKVError("bench --only gpu: needs CUDA, and torch.cuda.is_available() is False here")
    rows = bench_copies(block_sizes, regions, device="cuda", **kw)
    peaks = {b: _dma_peak(b) for b in block_sizes}
    for row in rows:
        row["pinned_dma_gbps"] = peaks[row["block_bytes"]]["d2h" if row["op"] == "store" else "h2d"]
    out = {"device": torch.cuda.get_device_name(), "rows": rows}
    if inflight is not None:
        from .inflight import bench_inflight

        settings = {"block_sizes": INFLIGHT_BLOCK_SIZES, **inflight}
        out["link_gbps"] = pinned_dma_gbps(LINK_BYTES)
        out["inflight"] = judge_inflight(bench_inflight(device="cuda", **settings), out["link_gbps"])
    return out


INFLIGHT_BLOCK_SIZES = (16 << 10, 256 << 10, 2 << 20)
LINK_BYTES = 128 << 20  # one DMA this large: the link's own rate (the yardstick "of the link")


def judge_inflight(rows: list[dict], link: dict[str, float], peaks: dict[int, dict[str, float]] | None = None) -> list[dict]:
    """Each row's GB/s against one pinned DMA of a call's bytes (``of_dma``) and against the link (``of_link``),
    with the issue's targets (targets.TARGETS) where one applies; the host us against theirs."""
    peaks = peaks if peaks is not None else {}
    for row in rows:
        b = row["block_bytes"]
        if row["op"] == "both":
            row["target_min"] = TARGETS["gpu_both_ratio_min"]
            row["meets_target"] = row["ratio"]["median"] >= row["target_min"]
            continue
        if b not in peaks:
            peaks[b] = _dma_peak(b)
        way = "d2h" if row["op"] == "store" else "h2d"
        ours = row["ours_gbps"]["median"]
        row["pinned_dma_gbps"], row["link_gbps"] = peaks[b][way], link[way]
        row["of_dma"], row["of_link"] = round(ours / peaks[b][way], 3), round(ours / link[way], 3)
        goal, measure = _goal(b, row["inflight"], TARGETS["gpu_of_dma_min"])
        if goal is not None:
            row["target_min"], row["target_of"] = goal, measure
            row["meets_target"] = row[measure] >= goal
        host = TARGETS["gpu_host_us_max"]
        row["host_meets_target"] = (row["host_us"]["engine"]["median"] <= host["engine"]
                                    and row["host_us"]["whole"]["median"] <= host["whole"])  # fmt: skip
    return rows


def _goal(block_bytes: int, n: int, goals: dict) -> tuple[float | None, str]:
    name = {16 << 10: "16KiB", 256 << 10: "256KiB", 2 << 20: "2MiB"}.get(block_bytes)
    measure = "of_link" if name == "16KiB" else "of_dma"  # 16 KiB: "of the link" (its 1 MiB DMA is itself slow)
    for depth, goal in goals.get(name, {}).items():  # "N": exactly N in flight; "N+": N or more
        least = int(depth.rstrip("+"))
        if n >= least if depth.endswith("+") else n == least:
            return goal, measure
    return None, measure


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
