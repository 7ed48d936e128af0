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


def lmcache_args(port: int) -> dict:
    from vllm.config import KVTransferConfig

    return {"kv_transfer_config": KVTransferConfig(
        kv_connector="LMCacheMPConnector", kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                   "lmcache.mp.mp_transfer_mode": "lmcache_driven"},
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
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 1), detokenize=False)
    for step in spec["steps"]:
        if step.get("reset"):
            llm.reset_prefix_cache()
        elif "sleep" in step:
            time.sleep(step["sleep"])
        else:
            params = sp
            if "max_tokens" in step:
                params = sp.clone()
                params.max_tokens = step["max_tokens"]
            t = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["generate"]], params, use_tqdm=False)
            report.append({"outputs": [engine_proc.result(o) for o in outs], "wall_s": time.monotonic() - t})
    engine_proc.settle(spec)
    llm.llm_engine.engine_core.shutdown()
    return report


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
    steps = run(spec)
    print("ENGINE_REPORT " + json.dumps({"steps": steps, **engine_proc.stats_report(spec)}), flush=True)


if __name__ == "__main__":
    main()
