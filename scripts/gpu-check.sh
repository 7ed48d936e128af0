#!/usr/bin/env bash
# The GPU check in one command (issues 27, 38): install carried wheels, build the native core, run the GPU
# tests (make test-gpu's set, the slow realistic batch and the ShardCopier tests included), `tiered-kv bench
# --only gpu --json`, the end-to-end case at three geometries for every copy path, the direct road (issue 46)
# included, with host us per submit (scripts/gpu_e2e.py), the
# model's compute beside the copies per path (scripts/gpu_compute_beside.py), and
# the vLLM-free TP=2 ShardCopier bench (ranks as threads, as before), the ShardCopier with a process per rank
# blocking in wait(), 16 and 64 MiB jobs, 1 and 2 in flight (python -m tiered_kv.bench.copier); write ONE JSON with the device's name, the copy path chosen, GB/s
# per direction and each case's ratio to one pinned DMA of the same bytes. About 5 minutes on an H200.
#
#   scripts/gpu-check.sh [OUT_DIR]        (default: ./gpu-check; the JSON is OUT_DIR/gpu-check.json)
#
# Without CUDA it runs the same steps as a dry run: each says what it would run and that it was skipped
# because no CUDA was found, the JSON says {"cuda": false, "dry_run": true, ...}, and it exits 0.
# Environment: PYTHON (default .venv/bin/python, else python3), GPU_CHECK_TIMEOUT (seconds per step, 900),
# GPU_CHECK_WHEELS (default shared/wheels), GPU_CHECK_TESTS=0 to skip the pytest step (figures only).
#
# Carrying what a bare GPU machine lacks (the H200 of 2026-12-04 had torch, triton, cuda-bindings, aiofiles,
# uvloop, pyyaml, xxhash, numpy and a compiler; it lacked pydantic, pytest, pytest-asyncio, hypothesis and
# redis): on a machine with a package index run scripts/gpu-wheels.sh, which downloads their cp312 wheels
# and dependencies into shared/wheels, and carry that folder beside the checkout (shared/ travels with it).
# The first step below installs them with `pip install --no-index --find-links shared/wheels ...`.
# A bare GPU machine needs: a CUDA build of torch (e.g. torch==2.13.0 from download.pytorch.org/whl/cu128),
# numpy, pyyaml, pydantic>=2.5, xxhash, prometheus-client, aiofiles, uvloop, rich, pybind11, pytest>=8.4,
# pytest-asyncio>=1.4, hypothesis, redis[hiredis] (tests/remote), and a C++17 compiler for the core.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STEP_TIMEOUT="${GPU_CHECK_TIMEOUT:-900}"

CUDA_INFO="$("$PY" - <<'PY' 2>&1
import torch
if torch.cuda.is_available():
    print("yes", torch.cuda.device_count(), torch.cuda.get_device_name(0), torch.version.cuda, sep="|")
else:
    print("no", torch.__version__, torch.version.cuda or "cpu-only build", sep="|")
PY
)"
if [ "${CUDA_INFO%%|*}" = "yes" ]; then
    CUDA=1
    echo "gpu-check: CUDA found: $CUDA_INFO"
else
    CUDA=0
    echo "gpu-check: no CUDA found (torch.cuda.is_available() is False: $CUDA_INFO); DRY RUN, every step is skipped"
fi

declare -A RC
step() {  # step NAME LOG CMD...: run it (or, without CUDA, say it would have), remember its exit status
    local name="$1" log="$2"
    shift 2
    if [ "$CUDA" = 0 ]; then
        echo "gpu-check: [$name] skipped, no CUDA found; would run: $*"
        RC[$name]="skipped"
        return
    fi
    echo "gpu-check: [$name] $*"
    timeout "$STEP_TIMEOUT" "$@" >"$OUT/$log" 2>"$OUT/$log.stderr"
    local rc=$?
    RC[$name]=$rc
    tail -n 5 "$OUT/$log" "$OUT/$log.stderr"
    echo "gpu-check: [$name] exit status $rc (log: $OUT/$log)"
}

WHEELS="${GPU_CHECK_WHEELS:-shared/wheels}"
NEEDS="pydantic pytest pytest-asyncio hypothesis redis"
if [ "$CUDA" = 0 ]; then
    step wheels wheels.log "$PY" -m pip install --no-index --find-links "$WHEELS" $NEEDS
elif "$PY" -c "import pydantic, pytest, pytest_asyncio, hypothesis, redis" 2>/dev/null; then
    echo "gpu-check: [wheels] $NEEDS already importable: nothing to install"
    RC[wheels]=0
elif [ -d "$WHEELS" ]; then
    step wheels wheels.log "$PY" -m pip install --no-index --find-links "$WHEELS" $NEEDS
else
    echo "gpu-check: [wheels] $NEEDS are missing and there is no $WHEELS: carry them (see the top of this script)"
    RC[wheels]="missing"
fi
step build build.log "$PY" setup.py -q build_ext --inplace
if [ "${GPU_CHECK_TESTS:-1}" = 0 ]; then
    echo "gpu-check: [tests] skipped (GPU_CHECK_TESTS=0)"; RC[tests]="skipped"
else
    # Segments and tmp files on /dev/shm: CUDA page-locks a shared mapping only on tmpfs (issue 38).
    step tests tests.log "$PY" -m pytest -q -p no:cacheprovider -m gpu tests \
        --junitxml="$OUT/tests.xml" --basetemp="$( [ -d /dev/shm ] && echo /dev/shm || echo /tmp )/tkv-gpu-check-$$"
fi
step bench bench.json "$PY" -m tiered_kv.cli bench --only gpu --json
step e2e e2e.log "$PY" scripts/gpu_e2e.py --json "$OUT/e2e.json"
step compute-beside compute-beside.log "$PY" scripts/gpu_compute_beside.py --json "$OUT/compute-beside.json"
step shard-bench shard-bench.log "$PY" scripts/bench_shard_copier.py --world 2 --engine cuda \
    --json "$OUT/shard-bench.json"
step copier-bench copier-bench.log "$PY" -m tiered_kv.bench.copier --engine cuda --json "$OUT/copier-bench.json"

RESULTS="$(for k in "${!RC[@]}"; do printf '%s=%s\n' "$k" "${RC[$k]}"; done)"
CUDA="$CUDA" CUDA_INFO="$CUDA_INFO" OUT="$OUT" RESULTS="$RESULTS" "$PY" - <<'PY'
import json
import os
from pathlib import Path

out = Path(os.environ["OUT"])
info = os.environ["CUDA_INFO"].split("|")
cuda = os.environ["CUDA"] == "1"
steps = dict(line.split("=", 1) for line in os.environ["RESULTS"].splitlines() if line)
doc = {"cuda": cuda, "dry_run": not cuda, "steps": steps}
if not cuda:
    doc["message"] = f"no CUDA found (torch {info[1]}, {info[2]}): nothing was run"
else:
    doc["device"], doc["device_count"], doc["cuda_version"] = info[2], int(info[1]), info[3]
    gbps = {}
    try:  # tiered-kv bench --only gpu --json: rows per op (store = D2H, load = H2D)
        bench = json.loads((out / "bench.json").read_text())
        rows = bench.get("gpu", {}).get("rows", [])
        for row in rows:
            key = f"cache_{row['op']}_{row['block_bytes']}B_{row['regions']}regions"  # store: D2H, load: H2D
            gbps[key] = {"ours": row.get("ours_gbps", {}).get("median"), "raw": row.get("raw_gbps", {}).get("median"),
                         "pinned_dma": row.get("pinned_dma_gbps")}
        for row in bench.get("gpu", {}).get("inflight", []):  # calls in flight, both ways at once (issue 46)
            key = f"inflight_{row['op']}_{row['block_bytes']}B_x{row['inflight']}"
            gbps[key] = {k: row.get(k) for k in ("of_dma", "of_link", "target_min", "meets_target")}
            gbps[key]["ratio"] = row.get("ratio", {}).get("median")
            if "overlap" in row:  # both ways: the two alone back to back / the pair
                gbps[key]["overlap"] = row["overlap"].get("median")
            if "host_us" in row:
                gbps[key]["host_us"] = {k: v.get("median") for k, v in row["host_us"].items()}
        doc["bench_gpu"] = bench.get("gpu")
    except (OSError, ValueError, KeyError) as exc:
        doc["bench_gpu_error"] = repr(exc)
    try:  # scripts/gpu_e2e.py: through the cache at two geometries, every copy path, ratio to one DMA
        e2e = json.loads((out / "e2e.json").read_text())
        doc["e2e"] = e2e
        for row in e2e.get("cases", []):
            if "store_gbps" in row:
                key = f"e2e_{row['geometry']}_{row['copy_path']}"
                gbps[key] = {k: row.get(k) for k in ("store_gbps", "load_gbps", "both_gbps", "store_of_dma", "load_of_dma",
                                                     "both_of_one_direction", "bytes_equal", "store_inflight_of_dma",
                                                     "load_inflight_of_dma")}
    except (OSError, ValueError, KeyError) as exc:
        doc["e2e_error"] = repr(exc)
    try:  # scripts/gpu_compute_beside.py: the model's compute beside the copies, per copy path
        doc["compute_beside"] = json.loads((out / "compute-beside.json").read_text())
    except (OSError, ValueError) as exc:
        doc["compute_beside_error"] = repr(exc)
    try:
        shard = json.loads((out / "shard-bench.json").read_text())
        gbps["shard_copier_tp2"] = shard["copies"]["gbps_per_rank"]
        doc["shard_bench"] = shard
    except (OSError, ValueError, KeyError) as exc:
        doc["shard_bench_error"] = repr(exc)
    try:  # a process per rank, wait() not polling: ratio per rank to one pinned DMA of the same bytes
        copier = json.loads((out / "copier-bench.json").read_text())
        doc["copier_bench"] = copier
        for row in copier["cases"]:
            key = f"shard_copier_procs_{row['direction']}_{row['job_mib']}MiB_{row['inflight']}inflight"
            gbps[key] = {"per_rank": [r["ours_gbps"] for r in row["per_rank"]], "sum": row["sum_gbps"],
                         "min_ratio_to_dma": row["min_ratio"], "shared_link": copier["shared_link"]}
    except (OSError, ValueError, KeyError) as exc:
        doc["copier_bench_error"] = repr(exc)
    doc["gbps"] = gbps
    try:  # the copy path the cache chose at start (the bench's rows name it too)
        doc["copy_path"] = next(r.get("copy_path") for r in doc["bench_gpu"]["rows"])
    except (KeyError, StopIteration, TypeError):
        doc["copy_path"] = None
    doc["ok"] = all(v in ("0", "skipped") for v in steps.values())
(out / "gpu-check.json").write_text(json.dumps(doc, indent=1) + "\n")
print(f"gpu-check: wrote {out / 'gpu-check.json'}")
print(json.dumps({k: doc[k] for k in ("cuda", "dry_run", "steps") if k in doc}))
PY
if [ "$CUDA" = 1 ]; then
    for k in "${!RC[@]}"; do [ "${RC[$k]}" = 0 ] || [ "${RC[$k]}" = skipped ] || exit 1; done
fi
exit 0
