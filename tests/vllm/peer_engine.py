"""One engine of the peers bench, in this process: no connector, tiered_kv or LMCache; prints one JSON line.

Usage: python peer_engine.py SPEC_JSON_FILE. The spec is engine_proc.py's (model, tp, max_tokens,
``tiered_kv`` config, ``num_gpu_blocks``, ...) plus ``"lmcache": {"port": N}``, which runs
vLLM's ``LMCacheMPConnector`` against an LMCache server already listening on that ZMQ port, in
its ``lmcache_driven`` mode (the server maps the engine's KV tensors from /dev/shm and copies
itself). Steps: ``{"generate": [[ids...], ...]}`` (one batch and its wall time; ``"max_tokens"``
overrides the spec's), ``{"reset": true}`` (``reset_prefix_cache()``) and ``{"sleep": seconds}``
(lets a connector's asynchronous stores land before the next step).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import engine_proc  # noqa: E402  (sets VLLM_CPU_KVCACHE_SPACE before vLLM is imported)

# The worker's ping to the server times out after one interval (10 s by default), and a TP=2 engine's
# first step on this loaded 2-core machine can hold the worker that long: the connector then runs
# "degraded" (no loads, no stores) and the hits it reports are not served. The server reaps a silent
# worker after --worker-reap-timeout-seconds (the bench sets 3 x this and more).
HEARTBEAT_S = 60.0


def lmcache_args(port: int) -> dict:
    from vllm.config import KVTransferConfig

    return {"kv_transfer_config": KVTransferConfig(
        kv_connector="LMCacheMPConnector", kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                   "lmcache.mp.mp_transfer_mode": "lmcache_driven",
                                   "lmcache.mp.heartbeat_interval": HEARTBEAT_S},
    )}  # fmt: skip


def run(spec: dict) -> list:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = engine_proc.engine_args(spec)
    if spec.get("lmcache"):
        args.update(lmcache_args(spec["lmcache"]["port"]))
    t0 = time.monotonic()
    llm = LLM(**args)
    report: list = [{"start_s": time.monotonic() - t0}]
    reset_failures, unreset = 0, False
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 1), detokenize=False)
    for step in spec["steps"]:
        if step.get("reset"):
            refused, ok = reset(llm)
            reset_failures += refused
            unreset = not ok
        elif "sleep" in step:
            time.sleep(step["sleep"])
        else:
            params = sp
            if "max_tokens" in step:
                params = sp.clone()
                params.max_tokens = step["max_tokens"]
            t = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["generate"]], params, use_tqdm=False)
            report.append({"outputs": [engine_proc.result(o) for o in outs], "wall_s": time.monotonic() - t,
                           "after_failed_reset": unreset})  # fmt: skip
            unreset = False
    engine_proc.settle(spec)
    llm.llm_engine.engine_core.shutdown()
    report[0]["reset_failures"] = reset_failures
    return report


def reset(llm, limit_s: float = 60.0) -> tuple[int, bool]:
    """``reset_prefix_cache()`` until it succeeds (it refuses while blocks are held, e.g. by a connector's
    delayed free), so an offload hit is never vLLM's own: how many times it refused, and whether it took
    within ``limit_s`` (if not, the next generate is flagged and its hit is not counted)."""
    failures, t0 = 0, time.monotonic()
    while not llm.reset_prefix_cache():
        failures += 1
        if time.monotonic() - t0 > limit_s:
            return failures, False
        time.sleep(0.1)
    return failures, True


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
    steps = run(spec)
    print("ENGINE_REPORT " + json.dumps({"steps": steps, **engine_proc.stats_report(spec)}), flush=True)


if __name__ == "__main__":
    main()
