"""Runs one vLLM engine in this process and plays a script of steps; prints one JSON line.

Usage: python engine_proc.py SPEC_JSON_FILE. The spec names the model dir, the
tiered_kv config (absent: no connector, the baseline) and the steps:
``{"generate": [[ids...], ...]}`` (one batch through LLM.generate),
``{"reset": true}`` (llm.reset_prefix_cache()) or ``{"concurrent": [[ids...], ...]}``
(all at once through AsyncLLM; the spec then sets ``"async": true``).
Each real test runs engines as subprocesses: a second engine in one process
is not something vLLM supports, and the restart test needs a fresh process anyway.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler and worker in this process: stats are readable

MAX_TOKENS = 12


def engine_args(spec: dict) -> dict:
    from vllm.config import KVTransferConfig

    args = dict(model=spec["model"], enforce_eager=True, block_size=32, max_model_len=1024,
                skip_tokenizer_init=True, dtype="bfloat16", seed=0)  # fmt: skip
    if spec.get("tiered_kv") is not None:
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"config": spec["tiered_kv"], "stats_file": spec.get("stats_file")},
        )
    return args


def result(out) -> dict:
    return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}


def run_sync(spec: dict) -> list:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(**engine_args(spec))
    report: list = [{"start_s": time.monotonic() - t0}]
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", MAX_TOKENS), detokenize=False)
    for step in spec["steps"]:
        if step.get("reset"):
            llm.reset_prefix_cache()
        else:
            t = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in step["generate"]], sp, use_tqdm=False)
            report.append({"outputs": [result(o) for o in outs], "wall_s": time.monotonic() - t})
    return report


async def run_async(spec: dict) -> list:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(spec)))
    report: list = [{"start_s": time.monotonic() - t0}]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)

    async def one(i: int, prompt: list[int]) -> dict:
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=f"r{i}-{time.monotonic_ns()}"):
            last = out
        return result(last)

    try:
        for step in spec["steps"]:
            if step.get("reset"):
                await engine.reset_prefix_cache()
            else:
                prompts = step.get("concurrent") or step["generate"]
                outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
                report.append({"outputs": list(outs)})
    finally:
        engine.shutdown()  # the engine core (another process under AsyncLLM) writes stats_file as it closes
    with open(spec["stats_file"]) as f:
        report.append(json.load(f))
    return report


def runtime_report() -> dict:
    from tiered_kv.integrations.vllm.runtime import all_runtimes

    runtimes = all_runtimes()
    if not runtimes:
        return {}
    return {"counters": dict(runtimes[0].counters), "stats": runtimes[0].stats()}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if spec.get("async"):
        steps = asyncio.run(run_async(spec))
        extra = steps.pop()
    else:
        steps = run_sync(spec)
        extra = runtime_report()
    print("ENGINE_REPORT " + json.dumps({"steps": steps, **extra}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
