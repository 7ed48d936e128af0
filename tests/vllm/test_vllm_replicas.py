"""integrations/vllm/replicas.py: how many TP ranks hold the same KV, read from vLLM's kv_cache_config.

Runs everywhere (no engine): the config objects are plain namespaces shaped like vLLM's, and where vLLM is
installed its own MLAAttentionSpec and KVCacheConfig are used as well.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from conftest import HAVE_VLLM

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.replicas import check_rank_replicas, kv_tp_replicas


class MLAAttentionSpec:  # named like vLLM's (the fallback reads the class name, duck-typed)
    pass


class FullAttentionSpec:
    pass


def groups(*specs) -> list:
    return [NS(kv_cache_spec=s) for s in specs]


def test_kv_tp_replicas_is_read_when_vllm_gives_it():
    vllm_config = NS(model_config=NS(use_mla=True))
    assert kv_tp_replicas(vllm_config, NS(kv_tp_replicas=2, kv_cache_groups=[]), 2) == 2
    assert kv_tp_replicas(vllm_config, NS(kv_tp_replicas=1, kv_cache_groups=groups(MLAAttentionSpec())), 2) == 1
    assert kv_tp_replicas(vllm_config, NS(kv_tp_replicas=2), 4) == 2  # consecutive pairs of ranks
    assert kv_tp_replicas(vllm_config, NS(kv_tp_replicas=8), 1) == 1  # TP=1: nothing to share
    with pytest.raises(ConfigError, match="kv_tp_replicas must be an int >= 1, got 0"):
        kv_tp_replicas(vllm_config, NS(kv_tp_replicas=0), 2)
    with pytest.raises(ConfigError, match="is 3, which does not divide the TP size 4"):
        kv_tp_replicas(vllm_config, NS(kv_tp_replicas=3), 4)


def test_without_the_attribute_mla_layers_are_replicated_on_every_rank():
    mla = NS(kv_cache_groups=groups(MLAAttentionSpec(), NS(kv_cache_specs={"a": MLAAttentionSpec()})))
    assert kv_tp_replicas(NS(model_config=NS(use_mla=True)), mla, 2) == 2
    hybrid = NS(kv_cache_groups=groups(MLAAttentionSpec(), FullAttentionSpec()))
    assert kv_tp_replicas(NS(model_config=NS(use_mla=True)), hybrid, 2) == 1  # one sharded layer: a copy per rank
    assert kv_tp_replicas(NS(model_config=NS(use_mla=False)), NS(kv_cache_groups=groups(FullAttentionSpec())), 2) == 1
    assert kv_tp_replicas(NS(model_config=NS(use_mla=True)), NS(kv_cache_groups=[]), 2) == 2  # no specs to read


def test_a_rank_that_reads_other_replicas_is_refused_naming_it():
    check_rank_replicas({0: NS(kv_replicas=2), 1: NS(kv_replicas=2)}, 2)
    with pytest.raises(ConfigError, match=r"kv_tp_replicas 2 .* but TP rank\(s\) \{1: 1\}"):
        check_rank_replicas({0: NS(kv_replicas=2), 1: NS(kv_replicas=1)}, 2)


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed in this venv")
def test_vllms_own_mla_spec_and_kv_cache_config():
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_cache_interface import MLAAttentionSpec as Spec

    spec = Spec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    assert cfg.kv_tp_replicas == 1  # vLLM's default, until its engine core sets it
    cfg.kv_tp_replicas = 2
    assert kv_tp_replicas(NS(model_config=NS(use_mla=True)), cfg, 2) == 2
    # As a vLLM before the attribute (a config without it): vLLM's own spec class decides.
    assert kv_tp_replicas(NS(model_config=NS(use_mla=True)), NS(kv_cache_groups=cfg.kv_cache_groups), 2) == 2
