"""Disk hits promoted into the CPU tier before they hold GPU blocks, in a real vLLM (issue 39 item 3).

A prompt stored by tiered_kv is pushed out to disk by other prompts (a CPU tier of 8 blocks); served again
after vLLM's own prefix cache was reset, its disk blocks are first promoted into CPU slots (vLLM is answered
None meanwhile), then loaded as a synchronous CPU hit. Its tokens and logprobs are vLLM's when it computes
the prompt itself.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK, FILLERS, cache_config, outputs, run_engine, same_output, tokens
from test_vllm_ends import gap

NEEDS_VLLM = True
pytestmark = pytest.mark.slow

PROMPT = tokens(81, 6 * BLOCK + 10)  # 6 whole blocks and a tail: fits the 8-block CPU tier
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}
SPEC = {"logprobs": True, "max_model_len": 1024, "env": ENV}


def test_a_disk_hit_is_promoted_then_served_with_vllms_own_outputs(wide_model_dir, tmp_path):
    for d in ("base", "tkv"):
        (tmp_path / d).mkdir()
    base = run_engine({"model": wide_model_dir, "steps": [{"generate": [PROMPT]}], **SPEC}, tmp_path / "base")
    ((own,),) = outputs(base)
    assert own["cached"] == 0  # vLLM computes the whole prompt
    cfg = cache_config(tmp_path / "tkv" / "disk", cpu="256KiB")
    steps = [{"generate": [PROMPT]}, *({"generate": [f]} for f in FILLERS), {"reset": True, "retry": True},
             {"generate": [PROMPT]}]  # fmt: skip
    report = run_engine({"model": wide_model_dir, "tiered_kv": cfg, "steps": steps, **SPEC}, tmp_path / "tkv")
    assert all(s.get("reset_ok", True) for s in report["steps"]), report["steps"]
    again = outputs(report)[-1][0]
    c = report["counters"]
    assert report["stats"]["cpu"]["slots"] == 8
    # Promoted from disk (no GPU blocks held meanwhile), then one synchronous CPU hit of every block.
    assert c["promotions"] == 1 and c["promoted_blocks"] >= 6, c
    assert c["sync_loads"] == 1 and c.get("load_error_blocks", 0) == 0, c
    assert again["cached"] >= 6 * BLOCK, again
    assert same_output(again, own), gap(again, own)
