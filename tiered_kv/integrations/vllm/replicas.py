"""Whether vLLM's KV is the same on several TP ranks (MLA), so tiered_kv stores one copy of it.

DeepSeek V2/V3 (MLA) keep one latent vector per token, computed from the full hidden state: every
tensor-parallel rank holds the same KV. vLLM 0.32 says so in ``kv_cache_config.kv_tp_replicas``
(v1/kv_cache_interface.py: "consecutive TP ranks holding identical KV for every layer (1: none)"), set in
the scheduler's and every worker's copy of the config by v1/core/kv_cache_utils.py
``kv_cache_groups_tp_replicas``: the gcd over every layer of ``tp_size // spec.max_tp_shards``, where MLA
layers (MLAAttentionSpec from mla_attention.py, DeepSeek's indexer) declare ``max_tp_shards=1`` and other
attention layers none (so a hybrid model with one sharded layer gets 1). That attribute is what is read.

A vLLM without the attribute (older releases) is read the way its own offloading spec did: replicated
across the whole TP group when every layer's spec is an ``MLAAttentionSpec`` (or, with no specs to read,
when ``model_config.use_mla``), not replicated otherwise.

The number feeds the segment's geometry (``kv_replicas`` of cross_process.SegmentInfo): the scheduler and
each worker compute it from their own copy of ``kv_cache_config``, the segment header records it, and the
scheduler checks each rank's handshake against its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ...cross_process import storage_ranks
from ...errors import ConfigError


def kv_tp_replicas(vllm_config: Any, kv_cache_config: Any, world_size: int) -> int:
    """Consecutive TP ranks whose KV is identical (1: none); it divides ``world_size`` (ConfigError otherwise)."""
    if world_size == 1:
        return 1
    raw = getattr(kv_cache_config, "kv_tp_replicas", None)
    if raw is None:  # a vLLM before kv_tp_replicas: MLA layers are replicated on every rank
        replicas = world_size if _all_mla(vllm_config, kv_cache_config) else 1
    else:
        replicas = raw
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ConfigError(f"kv_cache_config.kv_tp_replicas must be an int >= 1, got {raw!r}")
    storage_ranks(world_size, replicas)  # ConfigError naming both unless it divides the TP size
    return replicas


def check_rank_replicas(handshakes: Mapping[int, Any], mine: int) -> None:
    """Every rank's handshake must carry the scheduler's kv_replicas (ConfigError naming the ranks)."""
    bad = {r: getattr(m, "kv_replicas", 1) for r, m in handshakes.items() if getattr(m, "kv_replicas", 1) != mine}
    if bad:
        raise ConfigError(f"tiered_kv: the scheduler reads kv_tp_replicas {mine} from kv_cache_config (TP ranks "
                          f"holding identical KV, stored once) but TP rank(s) {bad} read otherwise; every process "
                          f"must store the same number of copies")  # fmt: skip


def _all_mla(vllm_config: Any, kv_cache_config: Any) -> bool:
    specs = list(_layer_specs(kv_cache_config))
    if specs:
        return all(any(c.__name__ == "MLAAttentionSpec" for c in type(s).__mro__) for s in specs)
    model_config = getattr(vllm_config, "model_config", None)
    return bool(getattr(model_config, "use_mla", False))


def _layer_specs(kv_cache_config: Any) -> Iterator[Any]:
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = getattr(group, "kv_cache_spec", None)
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        if isinstance(inner, Mapping):
            yield from inner.values()
        elif spec is not None:
            yield spec
