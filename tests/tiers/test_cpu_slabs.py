from __future__ import annotations

import pytest
import torch

import tiered_kv as tkv
from tiered_kv.tiers.cpu import CpuSlabs, mem_available


def test_one_block_major_slab_with_the_schedulers_slot_count():
    layout = tkv.KVLayout.from_block_bytes([4096, 300, 64], num_blocks=8)
    capacity = 10_000_000
    slots = layout.slots_for(capacity)
    slabs = CpuSlabs(layout, slots, pin="off")
    assert slots == capacity // (4096 + 300 + 64)
    assert [tuple(r.shape) for r in slabs.regions] == [(slots, 4096), (slots, 300), (slots, 64)]
    assert slabs.nbytes == slots * layout.bytes_per_block  # exact size, no power-of-two rounding
    assert tuple(slabs.slab.shape) == (slots, layout.bytes_per_block) and slabs.offsets == [0, 4096, 4396]
    slabs.slab[2:5].zero_()  # slabs are not zeroed: a slot is written before it is ever READY
    slabs.regions[1][3].fill_(7)  # region 1 of block 3 is 300 bytes inside row 3
    row = bytes(slabs.rows(3, 1))
    assert row[4096:4396] == b"\x07" * 300 and row.count(7) == 300
    run = slabs.rows(2, 3)  # consecutive slots are one contiguous buffer
    assert run.nbytes == 3 * layout.bytes_per_block and bytes(run[layout.bytes_per_block :][:len(row)]) == row
    assert not slabs.pinned
    slabs.release()


def test_pin_on_without_cuda_names_the_setting():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning works")
    layout = tkv.KVLayout.from_block_bytes([64], num_blocks=4)
    with pytest.raises(tkv.ConfigError, match="tiers.cpu.pin_memory"):
        CpuSlabs(layout, 4, pin="on")


def test_capacity_beyond_available_memory_names_the_numbers():
    available = mem_available()
    if available is None:
        pytest.skip("no /proc/meminfo")
    layout = tkv.KVLayout.from_block_bytes([1 << 20], num_blocks=4)
    with pytest.raises(tkv.ConfigError, match=r"tiers.cpu.capacity: .* only \d+ bytes"):
        CpuSlabs(layout, available // (1 << 20) + 10, pin="off")


@pytest.mark.parametrize("regions", [[4096], [4096, 300, 64], [1000, 24], [12_288, 12_288]])
@pytest.mark.parametrize("slots", [1, 3, 17, 1000])
def test_the_slab_is_the_start_of_its_own_page_aligned_storage(regions, slots):
    """Defect A (issue 27): torch's is_pinned() asks CUDA about the storage's first byte. A view ``skip``
    bytes into a larger tensor put that byte in the unregistered page before the slab, so a pinned slab
    was reported unpinned and CUDAStreamEngine refused it at start."""
    from tiered_kv.tiers.pinning import PAGE

    layout = tkv.KVLayout.from_block_bytes(regions, num_blocks=4)
    slabs = CpuSlabs(layout, slots, pin="off")
    storage = slabs.slab.untyped_storage()
    assert storage.data_ptr() % PAGE == 0
    assert storage.data_ptr() == slabs.slab.data_ptr() == slabs.regions[0].untyped_storage().data_ptr()
    assert storage.nbytes() % PAGE == 0 and storage.nbytes() >= slabs.nbytes  # it owns its last page
    slabs.release()
