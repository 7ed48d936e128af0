"""Time to first token of a disk hit, promoted first (issue 39 item 3) or loaded asynchronously, against recompute.

Not a test (run by hand, a few minutes on 2 cores): ``.venv-vllm/bin/python tests/vllm/bench_promotions.py``.
The random-weight Llama of bench_ttft.py (hidden 1024, 8 layers). A first engine computes each prompt (its
TTFT is recompute, with the store it triggers; write-through puts every block on disk); then fresh engine
processes over the same disk path, each with an empty CPU tier, serve the same prompts from disk: one with
promotions (``promote_hits``, the default: read into CPU slots while vLLM is answered None, then a
synchronous CPU hit), one without (an asynchronous load holding the GPU blocks during the read). TTFT is
the wall time of a 1-token generate; vLLM's prefix cache is reset before each.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import cache_config, run_engine, tokens  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

ROUNDS = 5
PROMPT_TOKENS = 992  # 31 blocks of 32, under max_model_len 1024 with one token to generate


def walls(report: dict) -> list[float]:
    return [s["wall_s"] for s in report["steps"] if "wall_s" in s][1:]


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tkv-bench-promote-"))
    model = str(make_tiny_llama(tmp / "llama-1024x8", hidden=1024, layers=8))
    cfg = cache_config(tmp / "disk", cpu="64MiB")
    cfg["tiers"]["disk"]["capacity"] = "512MiB"
    prompts = [tokens(100 + i, PROMPT_TOKENS) for i in range(ROUNDS)]
    warm = [{"generate": [tokens(99, 64)]}]
    steps = warm + [s for p in prompts for s in ({"generate": [p]}, {"reset": True})]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    base = {"model": model, "tiered_kv": cfg, "max_tokens": 1, "steps": steps, "env": env}
    recompute = walls(run_engine(base, tmp))
    runs = {}
    for name, extra in (("disk_promoted", {}), ("disk_async", {"promote_hits": False})):
        report = run_engine({**base, "connector_extra": extra}, tmp)
        cached = [s["outputs"][0]["cached"] for s in report["steps"] if "outputs" in s][1:]
        c = report["counters"]
        counts = {k: c.get(k, 0) for k in ("promotions", "promoted_blocks", "sync_loads", "loaded_blocks")}
        print(f"{name}: cached tokens {cached}, {counts}")
        runs[name] = walls(report)
    med = {"recompute": statistics.median(recompute), **{k: statistics.median(v) for k, v in runs.items()}}
    every = {k: [round(x * 1000, 1) for x in v] for k, v in {"recompute": recompute, **runs}.items()}
    print(f"TTFT median over {ROUNDS} ({PROMPT_TOKENS}-token prompts); every run in ms: {every}")
    for k, v in med.items():
        print(f"  {k:14s} {v * 1000:8.1f} ms   recompute / this = {med['recompute'] / v:5.2f}x")


if __name__ == "__main__":
    main()
