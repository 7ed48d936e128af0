"""KV cache groups without an engine (runs in every venv): what each kind of group needs for a hit, and
the bytes per block from vLLM 0.32's placements, aliased groups counted once (issue 26)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from tiered_kv.errors import ConfigError, LayoutError
from tiered_kv.integrations.vllm.block_bytes import group_bytes_per_block, scheduler_bytes_per_block
from tiered_kv.scheduler.groups import FULL, MAMBA, SLIDING, Group, KVGroups

NB, PAGE = 64, 16384


class FullAttentionSpec(NS):  # vLLM's spec classes are told apart by name (groups.py is duck-typed)
    pass


class SlidingWindowSpec(NS):
    pass


class MambaSpec(NS):
    pass


class ChunkedLocalAttentionSpec(NS):
    pass


def four_groups() -> NS:
    """Three sliding-window layers and one full one, as vLLM 0.32 lays them out with its hybrid allocator:
    one group per layer, each tensor placing its layer at offset 0 of the one backing allocation."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    tensors = [NS(size=NB * PAGE, layers=[n], layer_stride=NB * PAGE, block_stride=PAGE, offset=0) for n in names]
    specs = [SlidingWindowSpec(sliding_window=64, extra_retained_tokens=0)] * 3 + [FullAttentionSpec()]
    groups = [NS(layer_names=[n], kv_cache_spec=s) for n, s in zip(names, specs, strict=True)]
    return NS(num_blocks=NB, kv_cache_tensors=tensors, kv_cache_groups=groups, prefix_cacheable_group_ids=(0, 1, 2, 3))


def test_aliased_groups_count_each_page_once():
    kcc = four_groups()
    assert scheduler_bytes_per_block(kcc) == PAGE  # not 4 * PAGE, the sum over the four aliased tensors
    assert all(group_bytes_per_block(kcc, g.layer_names) == PAGE for g in kcc.kv_cache_groups)


def test_layers_of_one_group_side_by_side_add_up():
    tensor = NS(size=4 * NB * PAGE, layers=["a", "b", "c", "d"], layer_stride=NB * PAGE, block_stride=PAGE, offset=0)
    kcc = NS(num_blocks=NB, kv_cache_tensors=[tensor], kv_cache_groups=[])
    assert scheduler_bytes_per_block(kcc) == 4 * PAGE


def test_placements_that_do_not_cover_the_allocation_are_refused():
    tensor = NS(size=4 * NB * PAGE, layers=["a", "b"], layer_stride=NB * PAGE, block_stride=PAGE, offset=0)
    with pytest.raises(LayoutError, match="backing allocation"):
        scheduler_bytes_per_block(NS(num_blocks=NB, kv_cache_tensors=[tensor]))


def test_each_kind_needs_its_own_blocks_before_a_boundary():
    bs = 32
    assert Group(0, FULL, ()).needed(9, bs) == range(0, 9)
    # window 64 before token 288: the next token attends 225..288, so blocks 7 (224..255) and 8
    assert Group(0, SLIDING, (), window=64).needed(9, bs) == range(7, 9)
    assert Group(0, SLIDING, (), window=64).needed(1, bs) == range(0, 1)
    assert Group(0, SLIDING, (), window=33).needed(9, bs) == range(8, 9)
    assert Group(0, MAMBA, ()).needed(9, bs) == range(8, 9)  # the state block ending at the boundary


def test_groups_get_their_own_keys_and_one_group_keeps_the_plain_ones():
    groups = KVGroups.from_config(four_groups())
    assert [g.kind for g in groups.groups] == [SLIDING] * 3 + [FULL]
    assert len({g.salt for g in groups.groups}) == 4 and all(groups.groups[0].salt)
    one = NS(kv_cache_groups=[NS(layer_names=["x"], kv_cache_spec=FullAttentionSpec())])
    assert KVGroups.from_config(one).groups[0].salt == ()


def test_groups_that_cannot_be_restored_are_refused():
    def config(spec: NS) -> NS:
        return NS(kv_cache_groups=[NS(layer_names=["m"], kv_cache_spec=spec),
                                   NS(layer_names=["f"], kv_cache_spec=FullAttentionSpec())])  # fmt: skip

    with pytest.raises(ConfigError, match="mamba_cache_mode='align'"):
        KVGroups.from_config(config(MambaSpec(mamba_cache_mode="all")))
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec is not supported"):
        KVGroups.from_config(config(ChunkedLocalAttentionSpec()))
    assert KVGroups.from_config(config(MambaSpec(mamba_cache_mode="align"))).groups[0].kind == MAMBA
