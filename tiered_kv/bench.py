"""`tiered-kv bench`: every figure a ratio against the raw operation, measured in the same run."""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

from .sizes import format_size

TARGETS = {
    "cache_store_256KiB": 0.9,
    "cache_load_256KiB": 0.9,
    "cache_store_16KiB": 0.7,
    "cache_load_16KiB": 0.7,
    "lookup_ratio_max": 2.0,
    "disk_ratio": 0.8,
    "index_bytes_per_block_max": 200,
    "recovery_blocks_per_s": 100_000,
}


def run_all(sections: list[str] | None, quick: bool) -> dict[str, Any]:
    want = set(sections or ["transfer", "cache", "lookup", "index", "disk"])
    out: dict[str, Any] = {"targets": TARGETS}
    if "lookup" in want:
        from .bench_cache import bench_lookup

        out["lookup"] = bench_lookup(rounds=50 if quick else 300)
    if "index" in want:
        from .bench_cache import bench_index

        out["index"] = bench_index((10_000, 100_000) if quick else (10_000, 100_000, 1_000_000))
    if "cache" in want:
        from .bench_cache import bench_cache

        sizes = (16 << 10, 256 << 10) if quick else (16 << 10, 256 << 10, 2 << 20)
        out["cache"] = bench_cache(sizes, repeats=4 if quick else 12, rounds=1 if quick else 3)
    if "transfer" in want:
        from .transfer.bench import bench_transfer

        out["transfer"] = bench_transfer((16 << 10,), repeats=4) if quick else bench_transfer()
    if "gpu" in want or sections is None:
        from .bench_gpu import bench_gpu

        out["gpu"] = bench_gpu(repeats=4 if quick else 20)
    if "disk" in want:
        from .bench_disk import bench_disk, bench_recovery

        with tempfile.TemporaryDirectory(prefix="tkv-bench-", dir=".") as tmp:
            if quick:
                out["disk"] = bench_disk(tmp, block_sizes=(256 << 10,), blocks_per_size=16, repeats=1)
                out["recovery"] = bench_recovery(tmp, counts=(10_000,))
            else:
                out["disk"] = bench_disk(tmp)
                out["recovery"] = bench_recovery(tmp)
    return out


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if "cache" in result:
        t = Table("block", "in flight", "store GB/s", "raw GB/s", "store ratio", "load GB/s", "raw GB/s", "load ratio",
                  title="TieredKVCache vs raw index_select(out=), batches of 64")
        for r in result["cache"]:
            t.add_row(format_size(r["block_bytes"]), str(r["concurrency"]), f"{r['store_gbps']:.2f}", f"{r['raw_store_gbps']:.2f}",
                      f"{r['store_ratio']:.2f}", f"{r['load_gbps']:.2f}", f"{r['raw_load_gbps']:.2f}", f"{r['load_ratio']:.2f}")
        console.print(t)
    if "transfer" in result:
        t = Table("direction", "block", "engine GB/s", "raw GB/s", "ratio", title="copy engine alone vs raw")
        for r in result["transfer"]:
            t.add_row(r["direction"], format_size(r["block_bytes"]), f"{r['engine_gbps']:.2f}", f"{r['raw_gbps']:.2f}",
                      f"{r['ratio']:.2f}")
        console.print(t)
    if result.get("gpu"):
        t = Table("direction", "block", "engine GB/s", "cudaMemcpyAsync GB/s", "ratio", title="CUDA streams vs raw pinned copy")
        for r in result["gpu"]:
            t.add_row(r["direction"], format_size(r["block_bytes"]), f"{r['engine_gbps']:.2f}", f"{r['raw_gbps']:.2f}",
                      f"{r['ratio']:.2f}")
        console.print(t)
    if "lookup" in result:
        r = result["lookup"]
        console.print(f"lookup of a {r['prefix']}-block prefix: {r['lookup_us']:.1f} us vs dict loop "
                      f"{r['dict_loop_us']:.1f} us: ratio {r['ratio']:.2f} (target <= 2)")
    if "index" in result:
        t = Table("resident blocks", "index B/block", "with keys B/block", "1000-key lookup us", title="index scaling")
        for r in result["index"]:
            t.add_row(f"{r['resident_blocks']:,}", f"{r['index_bytes_per_block']:.0f}",
                      f"{r['with_key_objects_bytes_per_block']:.0f}", f"{r['lookup_1000_us']:.1f}")
        console.print(t)
    if "disk" in result:
        console.print("[bold]disk tier vs raw os.pwrite / os.preadv[/]")
        console.print_json(json.dumps(result["disk"], default=str))
    if "recovery" in result:
        console.print("[bold]restart recovery[/]")
        console.print_json(json.dumps(result["recovery"], default=str))


def run_bench_cli(args: argparse.Namespace) -> int:
    result = run_all(args.only, args.quick)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        render(result)
    return 0
