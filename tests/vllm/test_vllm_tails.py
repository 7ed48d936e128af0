"""Hits that end inside a block, and partial tails, in a real vLLM (issue 39 item 2).

Each prompt served from tiered_kv (vLLM's own prefix cache reset before it) is compared token for token and
logprob for logprob with vLLM serving the same prompt from its own prefix cache, in an engine of the same
shape; the tokens vLLM computed are its prompt length less ``num_cached_tokens``, and the connector's
counters (stats_file) say what was a tail.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK, cache_config, outputs, run_engine, same_output, tokens
from test_vllm_ends import BIND, gap

NEEDS_VLLM = True
pytestmark = pytest.mark.slow

ALIGNED = tokens(71, 960)  # 30 whole blocks: served up to its last token, which vLLM computes
TURN1 = tokens(72, 300)  # 9 blocks and a tail of 12 tokens
TURN2 = TURN1 + tokens(73, 50)  # the next turn: its block 9 begins with TURN1's tail
OTHER = TURN1[: 9 * BLOCK] + tokens(74, 12) + tokens(73, 50)  # TURN1's 9 blocks, then other tokens
SPEC = {"logprobs": True, "max_model_len": 1024, **BIND}


def test_hits_inside_a_block_give_vllms_own_outputs_and_compute_one_token(wide_model_dir, tmp_path):
    for d in ("base", "tkv"):
        (tmp_path / d).mkdir()
    # vLLM alone: each prompt served from its own prefix cache (whole blocks: 928 of 960, 288 of the rest).
    steps = [{"generate": [ALIGNED]}, {"generate": [ALIGNED]},
             {"generate": [TURN1]}, {"generate": [TURN2]}, {"generate": [TURN1]}, {"generate": [OTHER]}]  # fmt: skip
    base = run_engine({"model": wide_model_dir, "steps": steps, **SPEC}, tmp_path / "base")
    _, (own_aligned,), _, (own_turn2,), (own_turn1,), (own_other,) = outputs(base)
    assert (own_aligned["cached"], own_turn2["cached"], own_turn1["cached"]) == (928, 288, 288)
    # tiered_kv: vLLM's prefix cache reset before every prompt it serves.
    reset = {"reset": True, "retry": True}
    steps = [{"generate": [ALIGNED]}, reset, {"generate": [ALIGNED]},
             reset, {"generate": [TURN1]}, reset, {"generate": [TURN2]},
             reset, {"generate": [TURN1]}, reset, {"generate": [OTHER]}]  # fmt: skip
    report = run_engine({"model": wide_model_dir, "tiered_kv": cache_config(cpu="16MiB"), "steps": steps, **SPEC},
                        tmp_path / "tkv")  # fmt: skip
    assert all(s.get("reset_ok", True) for s in report["steps"]), report["steps"]
    _, (aligned,), _, (turn2,), (turn1,), (other,) = outputs(report)
    c = report["counters"]
    # The 960-token prompt: 30 blocks loaded, vLLM computes 1 token (its own prefix hit computes 32).
    assert aligned["cached"] == len(ALIGNED) - 1, aligned
    assert same_output(aligned, own_aligned), gap(aligned, own_aligned)
    # The next turn: 9 blocks and TURN1's 12-token tail (vLLM's own hit: 288).
    assert turn2["cached"] == len(TURN1), turn2
    assert same_output(turn2, own_turn2), gap(turn2, own_turn2)
    # TURN1 again: its 9 blocks and 11 of its 12 tail tokens; the last prompt token is computed.
    assert turn1["cached"] == len(TURN1) - 1, turn1
    assert same_output(turn1, own_turn1), gap(turn1, own_turn1)
    # Another tail after the same 9 blocks: only the blocks.
    assert other["cached"] == 9 * BLOCK, other
    assert same_output(other, own_other), gap(other, own_other)
    assert (c["tail_hits"], c["tail_hit_tokens"]) == (2, 12 + 11), c
    assert c["stored_tail_blocks"] >= 2 and c.get("load_error_blocks", 0) == 0, c  # TURN1's, TURN2's, ...
    assert c["loaded_blocks"] == 30 + (9 + 1) + (9 + 1) + 9, c
