"""Example: a packed (block-outermost, BLHNC) KV cache config for a plain 4-layer model, built with vLLM 0.32's own
functions on CPU tensors, no engine (python packed_kv_config_example.py). Tests can build packed layouts this way."""

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

layout = KVCacheLayout.BLHNC
vllm_config = VllmConfig(cache_config=CacheConfig(block_size=16))
vllm_config.cache_config.kv_cache_layout = layout.name  # what the EngineCore records after resolve_kv_cache_layout
spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(4)}
groups = get_kv_cache_groups(vllm_config, specs)
num_blocks = 10
cfg = get_kv_cache_config_from_groups(vllm_config, groups, available_memory=num_blocks * 4 * spec.page_size_bytes)
cfg.kv_cache_layout = layout.name
kv = allocate_kv_cache(cfg, torch.device("cpu"), layout)  # manager views, the ones a connector receives
print(cfg.num_blocks, [(t.size, t.layer_stride, t.block_stride, t.offset, t.layers) for t in cfg.kv_cache_tensors])
for n, t in kv.items():
    print(n, tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes())
