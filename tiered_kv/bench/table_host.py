"""Host time per call on the loop thread: the table path vs the per-group path, by region count (issue 38).

On the H200 a 64-block call spent about 6 ms of host time at 64 regions, one kernel launch per region
group per chunk. This measures, on any machine, what each path's Python and torch dispatch cost for one
64-block call with scattered GPU ids, at 8 / 64 / 128 regions: the same enqueue functions the CUDA engine
runs, driven on CPU tensors with 8-byte rows (so moving the bytes costs next to nothing and the figure
is the host's). The table path's kernel launch is counted but not run (one launch per chunk whatever the
region count; Triton's own launch cost, tens of microseconds, is a GPU-run figure); the group path runs
its real per-group torch ops. The figure to read is how each path scales with regions, as a ratio.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..transfer.engines.index_ring import IndexRing
from ..transfer.engines.staged import Staging, enqueue_store, gpu_groups, host_slabs
from ..transfer.engines.table import DeviceIds, build_table, enqueue_table

REGIONS = (8, 64, 128)


def bench_table_host(regions=REGIONS, *, blocks: int = 64, calls: int = 200, row: int = 8) -> list[dict]:
    """One row per region count: host µs per call (median of ``calls``) for each path, and launches."""
    # One torch thread: the CPU stand-in's "DMAs" are real memcpys, and torch's intra-op pool waking for
    # them (milliseconds after an idle gap) would be timed as host time that a CUDA copy never spends.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_case(n_regions, blocks, calls, row) for n_regions in regions]
    finally:
        torch.set_num_threads(threads)


def _case(n_regions: int, blocks: int, calls: int, row: int) -> dict:
    cpu_dev = torch.device("cpu")
    num = 4 * blocks
    # Per layer one storage of K and V (region-major, as KVLayout.from_tensors cuts it): groups of 2.
    storages = [torch.zeros((2, num, row), dtype=torch.uint8) for _ in range(max(1, n_regions // 2))]
    gpu = [s[kv] for s in storages for kv in range(2)][:n_regions]
    slab = torch.zeros((num, n_regions * row), dtype=torch.uint8)
    cpu = list(torch.split(slab, [row] * n_regions, dim=1))
    slabs = host_slabs(cpu)
    tables = [build_table(gpu, s, cpu_dev) for s in slabs]
    groups = [gpu_groups(gpu, s) for s in slabs]
    ids = DeviceIds(IndexRing(1 << 14, pin=False), cpu_dev)
    staging = Staging(cpu_dev, 64 << 20)
    rng = np.random.default_rng(n_regions)
    launches = [0]

    def count(*_a, **_k) -> None:
        launches[0] += 1

    def table(g: np.ndarray, s: np.ndarray, direct: bool) -> None:
        keep: list = []
        enqueue_table(False, tables, slabs, g, s, ids, keep, staging=None if direct else staging, launch=count)
        ids.ring.seal(_Done())

    def grouped(g: np.ndarray, s: np.ndarray) -> None:
        enqueue_store(gpu, slabs, g, s, staging, torch.from_numpy, None, groups)

    timed = {"table_direct": lambda g, s: table(g, s, True), "table": lambda g, s: table(g, s, False),
             "groups": grouped}  # fmt: skip
    us: dict[str, list[float]] = {k: [] for k in timed}
    for _ in range(calls):
        g = rng.choice(num, blocks, replace=False).astype(np.int64)  # scattered GPU ids
        first = int(rng.integers(0, num - blocks))
        s = np.arange(first, first + blocks, dtype=np.int64)  # a run of slots, as a fresh CPU tier hands out
        for name, fn in timed.items():  # interleaved: a pair taken moments apart sees the same neighbours
            t0 = time.perf_counter()
            fn(g, s)
            us[name].append((time.perf_counter() - t0) * 1e6)
    per_call = launches[0] / (2 * calls)
    med = {k: round(statistics.median(v), 1) for k, v in us.items()}
    return {"regions": n_regions, "blocks": blocks, "host_us": med, "table_launches_per_call": per_call,
            "group_launches_per_call": sum(len(g) for g in groups)}  # fmt: skip


class _Done:
    """A completed event for the ring (nothing runs asynchronously on the CPU)."""

    def query(self) -> bool:
        return True
