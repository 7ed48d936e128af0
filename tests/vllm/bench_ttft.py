"""Time to first token with a long shared prefix: recompute vs a tiered_kv CPU hit vs a disk hit.

Not a test (run by hand, ~3 min on 2 cores): ``.venv-vllm/bin/python tests/vllm/bench_ttft.py``.
Builds a random-weight Llama big enough that prefill costs real time (hidden 1024, 8 layers),
then runs two engine processes over one disk path: the first measures recompute (with the store
it triggers) and CPU hits, the second (a fresh process, empty CPU tier) disk hits; a third engine
without the connector gives vLLM's own recompute time. TTFT is the wall time of a
1-token generate.
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


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tkv-bench-"))
    model = str(make_tiny_llama(tmp / "llama-1024x8", hidden=1024, layers=8))
    cfg = cache_config(tmp / "disk", cpu="64MiB")
    cfg["tiers"]["disk"]["capacity"] = "64MiB"
    prompts = [tokens(100 + i, PROMPT_TOKENS) for i in range(ROUNDS)]
    warm = [{"generate": [tokens(99, 64)]}]
    first = warm + [s for p in prompts for s in ({"generate": [p]}, {"reset": True}, {"generate": [p]},
                                                  {"reset": True})]  # fmt: skip
    spec = {"model": model, "tiered_kv": cfg, "max_tokens": 1, "steps": first}
    r1 = run_engine(spec, tmp)
    walls = [s["wall_s"] for s in r1["steps"] if "wall_s" in s][1:]
    recompute, cpu_hit = walls[0::2], walls[1::2]
    r2 = run_engine({**spec, "steps": warm + [s for p in prompts for s in ({"generate": [p]}, {"reset": True})]}, tmp)
    disk_hit = [s["wall_s"] for s in r2["steps"] if "wall_s" in s][1:]
    steps0 = warm + [s for p in prompts for s in ({"generate": [p]}, {"reset": True})]
    r0 = run_engine({"model": model, "max_tokens": 1, "steps": steps0}, tmp)  # vLLM alone: no connector
    plain = [s["wall_s"] for s in r0["steps"] if "wall_s" in s][1:]
    cached = [s["outputs"][0]["cached"] for s in r2["steps"] if "outputs" in s][1:]
    med = {k: statistics.median(v) for k, v in
           {"no_connector": plain, "recompute": recompute, "cpu_hit": cpu_hit, "disk_hit": disk_hit}.items()}  # fmt: skip
    print(f"start_s first/second engine: {r1['steps'][0]['start_s']:.1f} / {r2['steps'][0]['start_s']:.1f}")
    print(f"TTFT median over {ROUNDS} ({PROMPT_TOKENS}-token prompts; disk-hit cached tokens {cached}):")
    for k, v in med.items():
        print(f"  {k:12s} {v * 1000:8.1f} ms   vLLM alone / this = {med['no_connector'] / v:5.2f}x")


if __name__ == "__main__":
    main()
