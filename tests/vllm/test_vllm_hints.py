"""Session hints that rank, through a real vLLM engine (bench_hints.py's chat workload, its strongest row).

24 one-off requests of 256 tokens between turns push 192 blocks through a 160-block CPU tier, so without
hints nothing of the conversations survives to their next turn; with hints (expect_followup) their blocks
outrank the one-off ones and nearly every reusable token is served from the tier.
"""

from __future__ import annotations

import pytest
from bench_hints import ceiling, served

NEEDS_VLLM = True
pytestmark = pytest.mark.slow


def test_hinted_conversations_keep_their_blocks_against_heavy_one_off_traffic(model_dir, tmp_path):
    top = ceiling()
    assert top == pytest.approx(0.625)
    with_hints = served(model_dir, tmp_path, 24, hints=True)
    assert with_hints["served"] >= 0.9 * top, with_hints
    without = served(model_dir, tmp_path, 24, hints=False)
    assert without["served"] < 0.5 * with_hints["served"], (without, with_hints)
    # The last turn ended every session: their blocks were released (first to go), nothing was malformed.
    assert with_hints["counters"]["released_blocks"] > 0
    assert with_hints["counters"].get("malformed_hints", 0) == 0
