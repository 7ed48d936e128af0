"""Bytes per block of an MLA model at TP=2: the CPU segment, the disk record, the GPU->CPU copies.

Not a test (run by hand, ~1 min per engine on 2 cores)::

    .venv-vllm/bin/python tests/vllm/bench_mla_bytes.py [--before PYTHONPATH_OF_AN_OLDER_CHECKOUT]

Builds the tiny random-weight DeepSeek-V2 of the tests (tiny_hybrid.py: 2 layers, latent 576, bfloat16), runs vLLM at TP=2
with the connector (PROMPT_A, reset, PROMPT_B) and reads what the engine really used: the scheduler cache's
bytes per block and CPU slots, the disk namespace's record size and file, the bytes copied GPU->CPU per
stored block. The segment's size comes from tiers/segment_geometry.py (the function both halves size it
with; its name is unlinked once every process mapped it). ``--before`` runs the same engine with another
tiered_kv first on the path (e.g. a checkout from before MLA was stored once) for the measured "before"
column; without it the "before" column is the same geometry with one copy per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent))

from conftest import PROMPT_A, PROMPT_B, cache_config  # noqa: E402
from tiny_hybrid import make_tiny_hybrid  # noqa: E402

TP = 2


def run(model: str, work: Path, pythonpath: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    cfg = cache_config(work / "disk", shm=work / "shm")
    spec = {"model": model, "tp": TP, "tiered_kv": cfg, "stats_file": str(work / "stats.json"),
            "steps": [{"generate": [PROMPT_A]}, {"reset": True}, {"generate": [PROMPT_B]}]}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=pythonpath)
    proc = subprocess.run([sys.executable, str(HERE / "engine_proc.py"), str(work / "spec.json")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=work)  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ENGINE_REPORT ")), None)
    if line is None:
        raise SystemExit(f"engine failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(line[len("ENGINE_REPORT ") :])
    (ns,) = (work / "disk").glob("ns-*")
    meta = json.loads((ns / "namespace.json").read_text())
    stats, counters = report["stats"], report["counters"]
    return {
        "cache_bytes_per_block": stats["bytes_per_block"],
        "cpu_slots_in_8MiB": stats["cpu"]["slots"],
        "disk_record_bytes": meta["record_size"],
        "disk_shard": meta["shard"],
        "gpu_to_cpu_bytes_per_stored_block": stats["metrics"]["tiered_kv_bytes_total{gpu_to_cpu}"]
        / max(1, counters["stored_blocks"]),
        "tokens_b": report["steps"][-1]["outputs"][0]["tokens"],
    }


def segment_bytes_per_block(rank_bytes: int, kv_replicas: int, slots: int = 1000) -> float:
    from tiered_kv.tiers.segment_geometry import SegmentInfo

    info = SegmentInfo.for_engine("/dev/shm", "bench", world_size=TP, shard_bytes=rank_bytes, num_slots=slots,
                                  kv_replicas=kv_replicas)  # fmt: skip
    return (info.file_bytes - info.header_bytes) / slots


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="PYTHONPATH of a tiered_kv that stores a copy per rank (measured column)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tkv-mla-bench-"))
    model = str(make_tiny_hybrid(tmp / "dsv2", "deepseek-v2", dtype="bfloat16"))
    after = run(model, tmp / "after", str(HERE.parent.parent))
    rank_bytes = after["cache_bytes_per_block"]  # one stored copy: one rank's bytes
    after["segment_bytes_per_block"] = segment_bytes_per_block(rank_bytes, TP)
    if args.before:
        before = run(model, tmp / "before", args.before)
        source = f"measured with PYTHONPATH={args.before}"
    else:
        from tiered_kv.tiers.disk.format import DiskNamespace

        ns = DiskNamespace("m", "bfloat16", "tp-group-of2", TP * rank_bytes, 32)
        before = {"cache_bytes_per_block": TP * rank_bytes, "cpu_slots_in_8MiB": (8 << 20) // (TP * rank_bytes),
                  "disk_record_bytes": ns.record_size, "gpu_to_cpu_bytes_per_stored_block": TP * rank_bytes}  # fmt: skip
        source = "computed: the same geometry with one copy per rank"
    before["segment_bytes_per_block"] = segment_bytes_per_block(rank_bytes, 1)
    print(f"MLA tiny DeepSeek-V2 at TP={TP}; before: {source}")
    print(f"{'':36} {'before':>12} {'after':>12} {'after/before':>13}")
    for k in ("segment_bytes_per_block", "cache_bytes_per_block", "disk_record_bytes",
              "gpu_to_cpu_bytes_per_stored_block", "cpu_slots_in_8MiB"):  # fmt: skip
        print(f"{k:36} {before[k]:>12,.0f} {after[k]:>12,.0f} {after[k] / before[k]:>13.3f}")
    if "tokens_b" in before:
        print("greedy tokens of the hit equal before and after:", before["tokens_b"] == after["tokens_b"])
    print(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
