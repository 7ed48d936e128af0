"""Which sections run, with which settings, and the targets the figures are read against."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import TieredKVError
from .targets import TARGETS

SECTIONS = ("cache", "disk", "lookup", "memory", "host", "inflight", "call_cost", "gpu")

# Full run: about 75 s on the 2-core machine. Quick: a smoke run for tests, same method (>= 9 rounds).
FULL = {
    "copy": {},
    "disk": {},
    "lookup": {"rounds": 21},
    "manager": {"rounds": 21},
    "memory": {"blocks": 1_000_000},
    "host": {},
    "inflight": {},
    "call_cost": {},
}
QUICK = {
    "copy": {"block_sizes": (16 << 10,), "regions": (8, 128), "sample_bytes": 1 << 20, "round_bytes": 0,
             "working_set": 2 << 20},
    "disk": {"block_sizes": (16 << 10,), "sample_bytes": 1 << 20},
    "lookup": {"calls": 10, "rounds": 9},
    "manager": {"calls": 20, "rounds": 9, "slots": 16 * 64},
    "memory": {"blocks": 20_000},
    "host": {"calls": 40},
    "inflight": {"block_sizes": (16 << 10,), "depths": (1, 2)},
    "call_cost": {"rounds": 9, "calls": 10, "cpu_calls": 8},
}  # fmt: skip


def run_bench(sections: Sequence[str] | None = None, *, quick: bool = False, directory: str | None = None,
              progress=None) -> dict[str, Any]:  # fmt: skip
    """Run the chosen sections (all by default; gpu only where CUDA is) and return one JSON-able dict."""
    want = list(dict.fromkeys(sections or SECTIONS))
    cfg = QUICK if quick else FULL
    t0 = time.perf_counter()
    out: dict[str, Any] = {"meta": {
        "quick": quick, "batch_blocks": 64, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "ratio": "ours' speed / raw's per round (1.0 = parity); medians with quartiles and min-max",
    }, "targets": TARGETS}  # fmt: skip
    step = progress or (lambda name: None)
    if "cache" in want:
        from .copy import bench_copies

        step("cache: store/load vs raw copy")
        out["cache"] = [_judge_copy(r) for r in bench_copies(**cfg["copy"])]
    if "disk" in want:
        from .disk import bench_disk, bench_disk_store

        step("disk: spill/promote through the cache vs pwritev/preadv")
        with tempfile.TemporaryDirectory(prefix="tkv-bench-", dir=directory) as tmp:
            out["disk"] = [_judge(r, TARGETS["disk_ratio_min"]) for r in bench_disk(tmp, **cfg["disk"])]
        step("disk: the DiskStore alone, and restart recovery")
        with tempfile.TemporaryDirectory(prefix="tkv-bench-", dir=directory) as tmp:
            out["disk_store"] = bench_disk_store(tmp, quick=quick)
    if "lookup" in want:
        from .lookup import bench_lookup

        step("lookup vs dict loop")
        r = bench_lookup(**cfg["lookup"])
        r["target_max"] = TARGETS["lookup_time_ratio_max"]
        r["meets_target"] = r["time_ratio"]["median"] <= r["target_max"]
        out["lookup"] = r
        from .manager import bench_manager  # the other bookkeeping-vs-dict figure: a store's planning

        step("store planning vs dict-insert loop")
        r = bench_manager(**cfg["manager"])
        r["target_max"] = TARGETS["manager_time_ratio_max"]
        r["meets_target"] = r["time_ratio"]["median"] <= r["target_max"]
        out["manager"] = r
        # The same with a disk tier below, one policy over both: each store also moves 64 blocks down, so
        # it is the general path's cost (reported, no target: the figure to hold per call across changes).
        out["manager_hierarchy"] = []
        for policy in ("lru", "arc", "window"):
            step(f"store planning over CPU + disk ({policy}) vs dict-insert loop")
            slots = cfg["manager"].get("slots", 64 * 64)
            out["manager_hierarchy"].append(bench_manager(**cfg["manager"], disk_slots=2 * slots, policy=policy))
    if "memory" in want:
        from .memory import bench_memory

        step("memory per resident block")
        r = bench_memory(**cfg["memory"])
        r["target_max"] = TARGETS["memory_bytes_per_block_max"]
        r["meets_target"] = r["bytes_per_block"] <= r["target_max"]
        out["memory"] = r
    if "host" in want:
        from .table_host import bench_table_host

        step("host time per call: the table path vs the per-group path")
        rows = bench_table_host(**cfg["host"])
        last = rows[-1]
        ratio = round(last["host_us"]["table"] / last["host_us"]["groups"], 3)
        out["host"] = {"rows": rows, "time_ratio_at_most_regions": ratio, "target_max": TARGETS["host_time_ratio_max"],
                       "meets_target": ratio <= TARGETS["host_time_ratio_max"]}  # fmt: skip
    if "inflight" in want:
        from .inflight import bench_inflight

        step("calls in flight (1 and N), both directions at once, host us per call")
        out["inflight"] = bench_inflight(**cfg["inflight"])
    if "call_cost" in want:
        from .call_cost import bench_call_cost

        step("the cache's own cost per 64-block call (engine counted, not run)")
        rows = bench_call_cost(**cfg["call_cost"], directory=directory)
        for r in rows:
            r["target_max"] = TARGETS["call_cost_cache_us_max"]
            r["meets_target"] = r["cache_us"]["median"] <= r["target_max"]
        out["call_cost"] = rows
    if "gpu" in want:
        from .gpu import bench_gpu, cuda_available

        if cuda_available():
            step("gpu: D2H/H2D vs raw pinned copies, calls in flight, both directions")
            out["gpu"] = bench_gpu(**cfg["copy"], inflight=cfg["inflight"])
        else:
            out["gpu"] = {"skipped": "CUDA is not available (torch.cuda.is_available() is False)"}
    out["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _judge_copy(row: dict) -> dict:
    goals = TARGETS["cache_ratio_min"]
    if row["regions"] != goals["regions"]:
        return row
    goal = goals["16KiB"] if row["block_bytes"] <= 16 << 10 else goals["256KiB"]
    return _judge(row, goal)


def _judge(row: dict, goal: float) -> dict:
    row["target_min"] = goal
    row["meets_target"] = row["ratio"]["median"] >= goal
    return row


def run_bench_cli(args: argparse.Namespace) -> int:
    from .gpu import cuda_available

    if args.only and "gpu" in args.only and not cuda_available():
        # Asked for by name, so an empty section would read as a pass.
        raise TieredKVError("bench --only gpu: needs CUDA, and torch.cuda.is_available() is False here")
    if args.dir is not None and not os.path.isdir(args.dir):
        raise TieredKVError(f"bench --dir {args.dir!r}: not a directory")
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(name: str) -> None:
            print(f"tiered-kv bench: {name} ...", file=sys.stderr, flush=True)
    result = run_bench(args.only, quick=args.quick, directory=args.dir, progress=progress)
    if "skipped" in result.get("gpu", {}):
        print(f"tiered-kv bench: gpu section skipped: {result['gpu']['skipped']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from .render import render

        render(result)
    return 0
