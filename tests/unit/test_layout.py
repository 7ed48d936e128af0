"""The logical layout: every case here fails on the physical-size (quotient) approach."""

from __future__ import annotations

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


def test_sub_block_multiples():
    # dim 0 = 3 * num_blocks: three physical sub-blocks per logical block
    t = torch.zeros(12, 10, dtype=torch.uint8)
    layout = KVLayout.from_tensors({"x": t}, 4)
    assert layout.bytes_per_block == 30
    layout.regions[0][1].fill_(1)
    assert t[3:6].sum() == 30 and t[:3].sum() == 0 and t[6:].sum() == 0


def test_dim0_not_a_multiple_raises():
    with pytest.raises(tkv.LayoutError, match="dim 0 is 10.*num_blocks=4"):
        KVLayout.from_tensors({"x": torch.zeros(10, 8)}, 4)


def test_logical_size_that_does_not_divide_raises():
    storage = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(tkv.LayoutError, match="100 bytes"):
        KVLayout.from_tensors({"k": storage[:32].view(4, 8)}, 4, logical_sizes=[100])


def test_logical_size_beyond_physical_raises():
    storage = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(tkv.LayoutError, match="128 bytes is smaller than its logical size of 256"):
        KVLayout.from_tensors({"k": storage.view(4, 32)}, 4, logical_sizes=[256])


def test_scheduler_layout_matches_bound_layout():
    k = torch.zeros(8, 64, dtype=torch.float16)
    v = torch.zeros(8, 64, dtype=torch.float16)
    sched = KVLayout.from_specs([StorageSpec(8 * 128, 128), StorageSpec(8 * 128, 128)], 8)
    bound = sched.bind({"k": k, "v": v})
    assert bound.bytes_per_block == sched.bytes_per_block == 256
    assert bound.digest == sched.digest
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
        tensors = {"all": storage[:logical].view(regions * num_blocks, block_bytes)}
    layout = KVLayout.from_tensors(tensors, num_blocks)
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
