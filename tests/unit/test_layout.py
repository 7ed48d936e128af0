"""The logical layout: every case here fails on the physical-size (quotient) approach."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiered_kv as tkv
from tiered_kv.layout import KVLayout, StorageSpec, plan_regions


def naive_quotient_regions(storage_nbytes: int, num_blocks: int, block_bytes: int) -> int:
    """What the buggy code computed: regions from the *physical* size."""
    return storage_nbytes // (num_blocks * block_bytes)


def test_128_logical_bytes_in_4k_allocation_is_one_region():
    storage = torch.zeros(4096, dtype=torch.uint8)  # allocator rounded 128 bytes up to 4 KiB
    kv = storage[:128].view(4, 32)
    layout = KVLayout.from_tensors({"layer0": kv}, num_blocks=4)
    assert layout.num_regions == 1
    assert tuple(layout.regions[0].shape) == (4, 32)
    assert layout.bytes_per_block == 32
    assert naive_quotient_regions(4096, 4, 32) == 32  # the bug this guards against


def test_logical_sizes_bound_the_view_not_the_physical_storage():
    storage = torch.zeros(4096, dtype=torch.uint8)
    kv = storage.view(4, 1024)  # the tensor view covers the whole allocation ...
    layout = KVLayout.from_tensors({"k": kv[:, :32].contiguous()}, 4)  # (copy: its own storage)
    assert layout.bytes_per_block == 32
    # ... but the scheduler says only 128 bytes are logical: one region of 32-byte blocks
    layout = KVLayout.from_tensors({"k": storage[:128].view(4, 32)}, 4, logical_sizes=[128])
    assert layout.num_regions == 1 and layout.bytes_per_block == 32


def test_deepseek_v4_figures():
    physical, logical = 33_626_157_056, 33_626_154_240
    assert physical - logical == 2_816
    assert plan_regions(physical, logical, 4_793, 7_015_680) == 1
    with pytest.raises(tkv.LayoutError):
        # reshaping the physical storage does not divide
        plan_regions(physical, physical, 4_793, 7_015_680)


def test_physical_smaller_than_logical_names_both_numbers():
    with pytest.raises(tkv.LayoutError, match=r"1000.*2048"):
        plan_regions(1000, 2048, 4, 512)


def test_non_dividing_logical_size_names_the_numbers():
    with pytest.raises(tkv.LayoutError, match=r"130 bytes.*4 \* 32 = 128"):
        plan_regions(4096, 130, 4, 32)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_plan_regions_rejects_bad_numbers(bad):
    with pytest.raises(tkv.LayoutError):
        plan_regions(4096, 128, bad, 32)


def test_layers_sharing_one_storage_register_once():
    num_blocks, per_layer = 8, 8 * 64
    storage = torch.zeros(3 * per_layer + 4096, dtype=torch.float16)  # padded
    layers = {f"layer{i}": storage[i * per_layer : (i + 1) * per_layer].view(8, 4, 16) for i in range(3)}
    layout = KVLayout.from_tensors(layers, num_blocks)
    assert len(layout.storages) == 1
    assert layout.num_regions == 3
    assert layout.bytes_per_block == 3 * 64 * 2
    # the same tensor under two names (shared KV layers) is still one storage
    layout2 = KVLayout.from_tensors({"a": layers["layer0"], "b": layers["layer0"]}, num_blocks)
    assert layout2.num_regions == 1


def test_k_and_v_as_separate_tensors():
    k = torch.zeros(16, 2, 8, dtype=torch.bfloat16)
    v = torch.zeros(16, 2, 8, dtype=torch.bfloat16)
    layout = KVLayout.from_tensors({"k": k, "v": v}, 16)
    assert layout.num_regions == 2
    assert layout.bytes_per_block == 2 * (2 * 8 * 2)


def test_region_views_alias_the_kv_tensors():
    k = torch.zeros(4, 8, dtype=torch.float32)
    layout = KVLayout.from_tensors({"k": k}, 4)
    layout.regions[0][2].fill_(7)
    assert torch.all(k[2].view(torch.uint8) == 7)
    assert torch.all(k[1] == 0)


def test_sub_block_multiples_must_be_declared():
    # dim 0 = 3 * num_blocks: three physical sub-blocks per logical block, said by the caller
    t = torch.zeros(12, 10, dtype=torch.uint8)
    with pytest.raises(tkv.LayoutError, match=r"dim 0 is 12, expected num_blocks \* rows_per_block = 4 \* 1 = 4.*rows_per_block"):
        KVLayout.from_tensors({"x": t}, 4)
    layout = KVLayout.from_tensors({"x": t}, 4, rows_per_block=3)
    assert layout.bytes_per_block == 30
    layout.regions[0][1].fill_(1)
    assert t[3:6].sum() == 30 and t[:3].sum() == 0 and t[6:].sum() == 0


def test_dim0_not_a_multiple_raises():
    with pytest.raises(tkv.LayoutError, match="dim 0 is 10, expected num_blocks"):
        KVLayout.from_tensors({"x": torch.zeros(10, 8)}, 4)


def test_logical_size_beyond_what_the_views_cover_raises_naming_both():
    # e.g. the padded (physical) size passed by mistake: it used to add a bogus region
    storage = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(tkv.LayoutError, match=r"logical size 100 .* exceeds the 32 bytes"):
        KVLayout.from_tensors({"k": storage[:32].view(4, 8)}, 4, logical_sizes=[100])
    with pytest.raises(tkv.LayoutError, match=r"logical size 64 .* exceeds the 32 bytes"):
        KVLayout.from_tensors({"k": storage[:32].view(4, 8)}, 4, logical_sizes=[64])
    with pytest.raises(tkv.LayoutError, match=r"reaches byte 32 .* past the logical size 16"):
        KVLayout.from_tensors({"k": storage[:32].view(4, 8)}, 4, logical_sizes=[16])


def test_logical_size_beyond_physical_raises():
    storage = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(tkv.LayoutError, match="logical size 256 .* exceeds the 128 bytes"):
        KVLayout.from_tensors({"k": storage.view(4, 32)}, 4, logical_sizes=[256])


def test_scheduler_layout_matches_bound_layout():
    k = torch.zeros(8, 64, dtype=torch.float16)
    v = torch.zeros(8, 64, dtype=torch.float16)
    sched = KVLayout.from_specs([StorageSpec(8 * 128, 128), StorageSpec(8 * 128, 128)], 8)
    bound = sched.bind({"k": k, "v": v})
    assert bound.bytes_per_block == sched.bytes_per_block == 256
    # A scheduler holding the worker's spec() has the same digest (so the same keys) and binds only to it.
    remote = KVLayout.from_spec(json.loads(json.dumps(bound.spec())))
    assert remote.digest == bound.digest and not remote.is_bound
    assert remote.bind({"k": k, "v": v}).digest == bound.digest
    with pytest.raises(tkv.LayoutError, match="digest"):
        remote.bind({"v": v, "k": k})
    assert sched.slots_for(10_000) == bound.slots_for(10_000) == 10_000 // 256


def test_bind_mismatch_raises_with_both_numbers():
    sched = KVLayout.from_specs([StorageSpec(8 * 256, 256)], 8)
    with pytest.raises(tkv.LayoutError, match=r"bytes_per_block=128.*bytes_per_block=256"):
        sched.bind({"k": torch.zeros(8, 64, dtype=torch.float16)})


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 64),
    block_bytes=st.integers(1, 512),
    regions=st.integers(1, 6),
    padding=st.integers(0, 8192),
    shared=st.booleans(),
)
def test_property_regions_never_pass_the_logical_size(num_blocks, block_bytes, regions, padding, shared):
    logical = regions * num_blocks * block_bytes
    storage = torch.zeros(logical + padding, dtype=torch.uint8)
    if shared:
        tensors = {
            f"l{r}": storage[r * num_blocks * block_bytes : (r + 1) * num_blocks * block_bytes].view(num_blocks, block_bytes)
            for r in range(regions)
        }
    else:
        tensors = {"all": storage[:logical].view(regions, num_blocks, block_bytes)}
    layout = KVLayout.from_tensors(tensors, num_blocks, block_dim=0 if shared else 1)
    base = storage.data_ptr()
    for view in layout.regions:
        end = view.data_ptr() + view.numel() - base
        assert end <= logical
    assert layout.bytes_per_block * num_blocks == logical
    assert plan_regions(logical + padding, logical, num_blocks, block_bytes) == regions


def test_errors_survive_python_O(tmp_path):
    """Validation must not be an assert: run the key checks with asserts stripped."""
    script = tmp_path / "check.py"
    script.write_text(
        "import torch, tiered_kv as t\n"
        "from tiered_kv.layout import KVLayout\n"
        "for args in [(1000, 2048, 4, 512), (4096, 130, 4, 32)]:\n"
        "    try:\n"
        "        t.plan_regions(*args)\n"
        "    except t.LayoutError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('no LayoutError for %r' % (args,))\n"
        "s = torch.zeros(4096, dtype=torch.uint8)\n"
        "lay = KVLayout.from_tensors({'k': s[:128].view(4, 32)}, 4)\n"
        "if lay.num_regions != 1: raise SystemExit('regions %d' % lay.num_regions)\n"
        "try:\n"
        "    t.load_config({'tiers': {'cpu': {'capacity': -1}}})\n"
        "except t.ConfigError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True, env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_k_then_v_stacked_on_dim0_is_refused_unless_declared():
    nb = 8
    kv = torch.arange(2 * nb * 4, dtype=torch.float32).view(2 * nb, 4)  # rows 0..7 are K, 8..15 are V
    with pytest.raises(tkv.LayoutError, match=r"dim 0 is 16, expected num_blocks \* rows_per_block = 8 \* 1 = 8.*block_dim"):
        KVLayout.from_tensors({"kv": kv}, nb)
    layout = KVLayout.from_tensors({"kv": kv.view(2, nb, 4)}, nb, block_dim=1)
    assert layout.num_regions == 2 and layout.bytes_per_block == 2 * 16
    # block 1 is K row 1 and V row 9; nothing else
    k1, v1 = layout.regions[0][1].view(torch.float32), layout.regions[1][1].view(torch.float32)
    assert torch.equal(k1, kv[1]) and torch.equal(v1, kv[nb + 1])


def test_block_dim_1_with_two_blocks_is_ambiguous_unless_declared():
    # [2, nb, ...] with nb == 2: dim 0 equals num_blocks by accident
    kv = torch.arange(2 * 2 * 3, dtype=torch.int32).view(2, 2, 3)
    with pytest.raises(tkv.LayoutError, match=r"ambiguous: dims \[0, 1\] all equal num_blocks=2"):
        KVLayout.from_tensors({"kv": kv}, 2)
    layout = KVLayout.from_tensors({"kv": kv}, 2, block_dim={"kv": 1})
    assert layout.num_regions == 2
    assert torch.equal(layout.regions[0][1].view(torch.int32), kv[0, 1])  # K of block 1
    assert torch.equal(layout.regions[1][1].view(torch.int32), kv[1, 1])  # V of block 1
    as_blocks = KVLayout.from_tensors({"kv": kv}, 2, block_dim=0)  # declared the other way: one region
    assert as_blocks.num_regions == 1 and as_blocks.digest != layout.digest


def test_declarations_are_checked():
    t = torch.zeros(4, 8)
    with pytest.raises(tkv.LayoutError, match="names tensors that kv_caches does not have"):
        KVLayout.from_tensors({"k": t}, 4, block_dim={"v": 0})
    with pytest.raises(tkv.LayoutError, match="block_dim=2 is not one of its dims"):
        KVLayout.from_tensors({"k": t}, 4, block_dim=2)
    with pytest.raises(tkv.LayoutError, match="rows_per_block must be positive"):
        KVLayout.from_tensors({"k": t}, 4, rows_per_block=0)


def _digest(tensors, nb=4, **kw):
    return KVLayout.from_tensors(tensors, nb, **kw).digest


def test_digest_identifies_names_order_dtype_and_shape():
    k, v = torch.zeros(4, 2, 8, dtype=torch.float16), torch.zeros(4, 2, 8, dtype=torch.float16)
    base = _digest({"k": k, "v": v})
    assert _digest({"k": k.clone(), "v": v.clone()}) == base  # same layout, other memory
    assert _digest({"v": v, "k": k}) != base  # reordered: K would be served as V
    assert _digest({"key": k, "v": v}) != base  # renamed
    assert _digest({"k": k.view(4, 8, 2), "v": v.view(4, 8, 2)}) != base  # same bytes, reshaped
    bf = {"k": k.view(torch.bfloat16), "v": v.view(torch.bfloat16)}
    assert _digest(bf) != base  # same bytes, another dtype
    big = {"k": torch.zeros(9, 2, 8, dtype=torch.float16), "v": torch.zeros(9, 2, 8, dtype=torch.float16)}
    assert _digest(big, nb=9) == base  # num_blocks is not part of the identity: a restart may resize


def test_layout_dtype_and_block_tokens():
    k = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    layout = KVLayout.from_tensors({"k": k}, 4, block_tokens=16)
    assert layout.dtype == "bfloat16" and layout.block_tokens == 16
    raw = KVLayout.from_tensors({"k": torch.zeros(4, 64, dtype=torch.uint8)}, 4)
    assert raw.dtype is None and raw.block_tokens is None  # raw bytes carry no element type
