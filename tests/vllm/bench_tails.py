"""TTFT of a 960-token prompt served from the CPU tier against vLLM's own prefix hit, same engine (issue 39).

Not a test (run by hand, ~2 min per tree on 2 cores):
``.venv-vllm/bin/python tests/vllm/bench_tails.py [--tree DIR] [--rounds 5]``. ``--tree`` runs another
checkout's connector (e.g. main, before tails) under the same engine script. Each round takes a fresh
960-token prompt (30 blocks of 32) and computes it once. An engine without the connector then serves it
from vLLM's own prefix cache (928 tokens: whole blocks before the last token's); one with the connector
serves it, after ``reset_prefix_cache()``, from tiered_kv's CPU tier. (In one engine, vLLM's own hit
would be extended by the connector's last block.) TTFT is the wall time of a 1-token generate; medians
over the rounds (a random Llama of hidden 1024 x 8 layers, ``VLLM_CPU_OMP_THREADS_BIND`` as given or "0").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_vllm import engine  # noqa: E402
from conftest import cache_config, outputs, tokens  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

PROMPT_TOKENS = 960


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", help="the tiered_kv checkout whose connector to run (default: this one)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tkv-tails-"))
    model = str(make_tiny_llama(tmp / "llama-1024x8", hidden=1024, layers=8))
    warm = [{"generate": [tokens(99, 64)]}]
    prompts = [tokens(300 + i, PROMPT_TOKENS) for i in range(args.rounds)]
    reset = {"reset": True, "retry": True}
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")}
    spec = {"model": model, "max_tokens": 1, "env": env}
    own = engine({**spec, "steps": warm + [s for p in prompts for s in ({"generate": [p]}, {"generate": [p]})]},
                 tmp, None)  # fmt: skip
    report = engine({**spec, "tiered_kv": cache_config(cpu="64MiB"),
                     "steps": warm + [s for p in prompts for s in ({"generate": [p]}, reset, {"generate": [p]})]},
                    tmp, args.tree)  # fmt: skip
    own_walls = [s["wall_s"] for s in own["steps"] if "wall_s" in s][1:]
    own_outs = [o[0] for o in outputs(own)][1:]
    walls = [s["wall_s"] for s in report["steps"] if "wall_s" in s][1:]
    outs = [o[0] for o in outputs(report)][1:]
    own_hit, tkv_hit = own_walls[1::2], walls[1::2]
    print(f"tree: {args.tree or 'this checkout'}; {args.rounds} rounds of a {PROMPT_TOKENS}-token prompt")
    print(f"  cached tokens: vLLM's own hit {sorted({o['cached'] for o in own_outs[1::2]})}, "
          f"tiered_kv's {sorted({o['cached'] for o in outs[1::2]})}")  # fmt: skip
    med = statistics.median
    print(f"  TTFT median: recompute {med(own_walls[0::2]) * 1e3:.1f} / {med(walls[0::2]) * 1e3:.1f} ms "
          f"(without / with the connector), vLLM's own hit {med(own_hit) * 1e3:.1f} ms, "
          f"tiered_kv CPU hit {med(tkv_hit) * 1e3:.1f} ms: {med(tkv_hit) / med(own_hit):.2f}x")  # fmt: skip
    print(f"  counters: { {k: v for k, v in report['counters'].items() if 'tail' in k or k == 'loaded_blocks'} }")


if __name__ == "__main__":
    main()
