"""The issue-19 bench: cost of the connector when nothing hits, and TTFT of a long shared prefix.

Not a test (run by hand; ~15 min on 2 cores; `make bench-vllm` runs bench_peers.py instead):
``PYTHONPATH=. .venv-vllm/bin/python tests/vllm/bench_vllm.py [--tree DIR] [--runs 3] [--tp 1|2] [nohit|ttft]``.
``--tree`` runs another checkout's connector (e.g. the commit before this work) under the same engine
script, so before and after differ only in tiered_kv. Every engine runs under vLLM's default engine.

- ``nohit``: 32 distinct 200-token prompts, 32 output tokens each, one batch; output tokens/s and
  the median decode step (vLLM's own per-request timestamps), with and without the connector, runs
  interleaved (plain, connector, plain, connector, ...), medians.
- ``ttft``: a ~900-token prompt, then ``reset_prefix_cache()`` and the same prompt: recompute vs a
  tiered_kv CPU hit (TTFT = wall time of a 1-token generate), medians over rounds of fresh prompts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import cache_config, outputs, run_engine, tokens  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

NOHIT_PROMPTS = [tokens(500 + i, 200) for i in range(32)]
TTFT_ROUNDS = 5
TTFT_TOKENS = 928  # 29 blocks of 32


def engine(spec: dict, tmp: Path, tree: str | None) -> dict:
    old = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = tree  # the connector's code comes from that checkout
    try:
        return run_engine(spec, tmp, timeout=900)
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def nohit(model: str, tmp: Path, tree: str | None, runs: int, tp: int) -> None:
    cfg = cache_config(tmp / "disk", cpu="64MiB")
    results: dict[str, dict[str, list[float]]] = {"plain": {"tok_s": [], "step_ms": []},
                                                  "connector": {"tok_s": [], "step_ms": []}}  # fmt: skip
    warm = {"generate": [tokens(499, 64)]}
    for _ in range(runs):
        for name in ("plain", "connector"):
            spec = {"model": model, "tp": tp, "max_tokens": 32, "log_stats": True,
                    "steps": [warm, {"generate": NOHIT_PROMPTS}]}  # fmt: skip
            if name == "connector":
                spec["tiered_kv"] = cfg
            report = engine(spec, tmp, tree)
            step = [s for s in report["steps"] if "outputs" in s][-1]
            n = sum(len(o["tokens"]) for o in step["outputs"])
            results[name]["tok_s"].append(n / step["wall_s"])
            results[name]["step_ms"].append(1000 * statistics.median(o["decode_s"] for o in step["outputs"]))
            print(f"  {name:9s} {results[name]['tok_s'][-1]:7.1f} tok/s, decode step "
                  f"{results[name]['step_ms'][-1]:6.2f} ms", flush=True)  # fmt: skip
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    print(f"no hits, TP={tp}, medians of {runs}: plain {med['plain']['tok_s']:.1f} tok/s "
          f"{med['plain']['step_ms']:.2f} ms; connector {med['connector']['tok_s']:.1f} tok/s "
          f"{med['connector']['step_ms']:.2f} ms; ratio {med['connector']['tok_s'] / med['plain']['tok_s']:.3f}x, "
          f"decode step {100 * (med['connector']['step_ms'] / med['plain']['step_ms'] - 1):+.1f} %")  # fmt: skip


def ttft(model: str, tmp: Path, tree: str | None, tp: int) -> None:
    """Per round: recompute, then after reset_prefix_cache() a tiered_kv CPU hit, then the same prompt
    again, served by vLLM's own GPU prefix cache (the floor: the engine's own cost of a prefix hit)."""
    cfg = cache_config(tmp / "disk", cpu="64MiB")
    cfg["tiers"]["disk"]["capacity"] = "64MiB"
    prompts = [tokens(700 + i, TTFT_TOKENS) for i in range(TTFT_ROUNDS)]
    steps = [{"generate": [tokens(699, 64)]}]
    for p in prompts:
        steps += [{"generate": [p]}, {"reset": True}, {"generate": [p]}, {"generate": [p]}, {"reset": True}]
    report = engine({"model": model, "tp": tp, "tiered_kv": cfg, "max_tokens": 1, "steps": steps}, tmp, tree)
    walls = [s["wall_s"] for s in report["steps"] if "wall_s" in s][1:]
    cached = [o[0]["cached"] for o in outputs(report)][1:][1::3]
    recompute, hit, gpu = (statistics.median(walls[i::3]) for i in range(3))
    print(f"TTFT, TP={tp}, {TTFT_TOKENS}-token prompt, median of {TTFT_ROUNDS}: recompute {recompute * 1000:.1f} ms, "
          f"tiered_kv CPU hit {hit * 1000:.1f} ms (cached tokens {cached}), vLLM's own prefix hit "
          f"{gpu * 1000:.1f} ms: hit / vLLM's hit {hit / gpu:.3f}x, recompute / hit {recompute / hit:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["nohit", "ttft"], choices=["nohit", "ttft"])
    ap.add_argument("--tree", help="the tiered_kv checkout whose connector to run (default: this one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tkv-bench-"))
    model = str(make_tiny_llama(tmp / "llama-1024x8", hidden=1024, layers=8))
    print(f"tree {args.tree or 'this checkout'}, TP={args.tp}", flush=True)
    if "nohit" in args.what:
        nohit(model, tmp, args.tree, args.runs, args.tp)
    if "ttft" in args.what:
        ttft(model, tmp, args.tree, args.tp)


if __name__ == "__main__":
    main()
