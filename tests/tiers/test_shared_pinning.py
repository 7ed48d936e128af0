"""A worker's CUDA copier page-locks only its own rank's sub-slab of the shared segment, by the CPU tier's rules."""

from __future__ import annotations

import pytest
import torch
from fake_cudart import PageLockingRuntime

from tiered_kv.cross_process.shard_copier import _pin
from tiered_kv.errors import PinningError
from tiered_kv.tiers.pinning import pin_chunks
from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment


@pytest.fixture
def runtime(monkeypatch):
    rt = PageLockingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    return rt


def segment(tmp_path, **kw):
    args = {"world_size": 2, "shard_bytes": 6000, "num_slots": 1000} | kw
    return SharedSegment.open(SegmentInfo.for_engine(str(tmp_path), "pin", **args))


def test_each_rank_registers_only_its_sub_slab_in_chunks_of_whole_pages_and_rows(tmp_path, runtime):
    # 6,000-byte shards: a chunk is lcm(4096, 6000) = 1,536,000 bytes = 256 rows, so 1,000 rows take 4 chunks
    seg = segment(tmp_path)
    try:
        regs = []
        for rank in range(2):
            start = len(runtime.calls)
            registration, dma_rows = _pin(seg, rank, None, 1 << 20)
            regs.append(registration)
            base = seg.shard(rank).ctypes.data
            assert base % 4096 == 0 and dma_rows == 256
            assert [(p - base, n) for p, n in runtime.calls[start:]] == [
                (0, 1_536_000), (1_536_000, 1_536_000), (3_072_000, 1_536_000), (4_608_000, 1_392_000)]  # fmt: skip
            assert sum(n for _, n in runtime.calls[start:]) == 6_000_000  # 1/TP of the segment's blocks
        assert runtime.last_error == 0  # both ranks in one address space: no page locked twice
        for registration in regs:
            registration.release()
        assert runtime.locked == {}
    finally:
        seg.close()


def test_with_64k_pages_no_rank_chunk_starts_in_a_page_already_registered(tmp_path, monkeypatch):
    """Defect C: with a 4096-byte header on a 64 KiB-page system, rank 0's first chunk shared a page with
    the header and each chunk after the first started inside a page the previous one locked."""
    info = SegmentInfo.for_engine(str(tmp_path), "pin64", world_size=2, shard_bytes=8192, num_slots=1000,
                                  page=65536)  # fmt: skip
    seg = SharedSegment.open(info)
    try:
        origin = seg.blocks.ctypes.data - info.header_bytes  # the mapping's start: page 0 of the emulated system
        rt = PageLockingRuntime(page=65536, origin=origin)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
        regs = [_pin(seg, rank, None, 1 << 20)[0] for rank in range(2)]
        assert rt.last_error == 0 and len(rt.calls) == 16  # 8 chunks of 1 MiB per rank
        assert all((p - origin) % 65536 == 0 for p, _ in rt.calls)
        for registration in regs:
            registration.release()
        # what a 4096-byte header did there: chunks of whole 64 KiB pages, 4096 bytes into the first page
        old = PageLockingRuntime(page=65536)
        chunks = pin_chunks(info.sub_slab_bytes, info.shard_bytes, 1 << 20, page=65536)
        for start, size in chunks[:2]:
            old.cudaHostRegister(4096 + start, size, 0)
        assert old.last_error == 712
    finally:
        seg.close()


def test_a_failed_registration_unregisters_what_was_locked(tmp_path, monkeypatch):
    rt = PageLockingRuntime(fail_call=3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    seg = segment(tmp_path)
    try:
        with pytest.raises(PinningError, match="rank 1's sub-slab of the shared CPU tier segment"):
            _pin(seg, 1, None, 1 << 20)
        assert rt.locked == {} and rt.last_error == 0
    finally:
        seg.close()
