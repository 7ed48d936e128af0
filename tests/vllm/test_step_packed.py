"""Every KV cache layout vLLM 0.32 can hand a connector, placed and viewed by vLLM's own functions (packed_kv.py)
and driven through the connector's real halves (step_harness.py): a prompt stored, its GPU blocks overwritten, a
CPU hit loaded back bit-exact. Block-outermost layouts (BLHNC, BLNHC, BHLNC) store each block id's whole packed
row, padding inside the row included; a padded allocation (a 4 KiB round-up, or a tail of whole rows) changes
nothing the scheduler or the worker counts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
import torch  # noqa: E402
from packed_kv import NB, allocate, full_attention, kv_cache_config  # noqa: E402
from step_harness import BS, Harness, request, store_prompt  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from tiered_kv.integrations.vllm.block_bytes import scheduler_bytes_per_block, worker_layout  # noqa: E402

NEEDS_VLLM = True

A = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41, 42]  # 3 full blocks
B = A[:12] + [51, 52, 53]
LAYERS = 3
PAGE = BS * 2 * 8 * 4  # tokens x K/V x width x float32
PACKED = [lay.name for lay in KVCacheLayout if lay.is_block_outermost]


def raw_rows(h: Harness) -> torch.Tensor:
    """The backing allocation as [NB, row] bytes (block-outermost: one row per block id)."""
    storage = next(iter(h.registered.values())).untyped_storage()
    row = scheduler_bytes_per_block(h.kcc)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (NB, row), (row, 1))


@pytest.mark.parametrize("layout", [lay.name for lay in KVCacheLayout])
def test_a_cpu_hit_round_trips_in_every_layout(tmp_path, layout):
    h = Harness(tmp_path, layers=LAYERS, kv_layout=layout)
    try:
        packed = KVCacheLayout[layout].is_block_outermost
        (t,) = h.kcc.kv_cache_tensors
        assert (t.block_stride > t.layer_stride) == packed
        assert scheduler_bytes_per_block(h.kcc) == LAYERS * PAGE == h.sched.report()["stats"]["bytes_per_block"]
        store_prompt(h, "a", A, [0, 1, 2, 3])
        for v in h.kv.values():  # another request's KV lands in the prompt's old blocks
            v[0:4] = -7.0
        b = request("b", B)
        n, is_async = h.admit(b, [10, 11, 12, 13])
        assert (n, is_async) == (3 * BS, False)
        h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n)])
        assert h.holds(B, [10, 11, 12], 3, kv=h.after_start)
        h.idle()
        assert h.counters()["loaded_blocks"] == 3
    finally:
        h.close()


@pytest.mark.parametrize("layout", PACKED)
def test_a_packed_block_is_stored_as_its_whole_row_padding_included(tmp_path, layout):
    h = Harness(tmp_path, layers=LAYERS, kv_layout=layout)
    try:
        rows = raw_rows(h)
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
        store_prompt(h, "a", A, [0, 1, 2, 3])  # the forward rewrites the pages; the rest of each row stays
        stored = rows[0:3].clone()
        rows[0:4] = 0
        b = request("b", B)
        n, _ = h.admit(b, [20, 21, 22, 23])
        h.step(new=[(b, [20, 21, 22, 23], n, len(B) - n)])
        assert torch.equal(rows[20:23], stored)  # byte for byte, row for row
        assert h.holds(B, [20, 21, 22], 3, kv=h.after_start)
    finally:
        h.close()


@pytest.mark.parametrize("layout", ["LBHNC", *PACKED])
@pytest.mark.parametrize("pad", [4096 - (NB * LAYERS * PAGE) % 4096, 2 * LAYERS * PAGE + 100],
                         ids=["4KiB-round-up", "whole-rows"])  # fmt: skip
def test_a_padded_allocation_counts_no_padding(tmp_path, layout, pad):
    h = Harness(tmp_path, layers=LAYERS, kv_layout=layout, pad=pad)
    try:
        storage = next(iter(h.registered.values())).untyped_storage()
        assert storage.nbytes() == NB * LAYERS * PAGE + pad  # physical > logical
        assert h.sched.report()["stats"]["bytes_per_block"] == LAYERS * PAGE  # padding is never a block, nor a row
        store_prompt(h, "a", A, [0, 1, 2, 3])
        for v in h.kv.values():
            v[0:4] = 0.0
        b = request("b", B)
        n, _ = h.admit(b, [NB - 4, NB - 3, NB - 2, NB - 1])  # the last blocks, next to the padding
        h.step(new=[(b, [NB - 4, NB - 3, NB - 2, NB - 1], n, len(B) - n)])
        assert h.holds(B, [NB - 4, NB - 3, NB - 2], 3, kv=h.after_start)
    finally:
        h.close()


def test_a_pool_whose_block_count_equals_another_dim_uses_the_dim_the_placements_name():
    # 64 blocks of [1 head, 4 tokens, 64 values]: dims 0 and 3 both 64. vLLM's placement says which is the block.
    kcc = kv_cache_config([full_attention(["x", "y"], width=32)], "LBHNC", num_blocks=64)
    views = allocate(kcc, "LBHNC")
    assert tuple(views["x"].shape) == (64, 1, BS, 64)
    with pytest.raises(Exception, match="ambiguous"):  # what guessing from shapes alone gives
        from tiered_kv.layout import KVLayout

        KVLayout.from_tensors(views, 64)
    layout = worker_layout(views, kcc, BS)
    assert layout.bytes_per_block == scheduler_bytes_per_block(kcc) == 2 * BS * 64 * 4
