"""A worker's CUDA copier page-locks its mapping of the shared segment by the CPU tier's rules."""

from __future__ import annotations

import pytest
import torch
from fake_cudart import PageLockingRuntime

from tiered_kv.errors import PinningError
from tiered_kv.split.worker import _pin
from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment


@pytest.fixture
def runtime(monkeypatch):
    rt = PageLockingRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    return rt


def test_the_rows_are_registered_in_chunks_of_whole_pages_and_rows(tmp_path, runtime):
    # rows of 6,000 bytes: a chunk is lcm(4096, 6000) = 1,536,000 bytes = 256 rows, so 1,000 rows take 4 chunks
    seg = SharedSegment.open(SegmentInfo.for_engine(str(tmp_path), "pin", world_size=2, shard_bytes=3000,
                                                    num_slots=1000))  # fmt: skip
    try:
        registration, dma_rows = _pin(seg, None, 1 << 20)
        base = seg.rows.ctypes.data
        assert base % 4096 == 0 and dma_rows == 256
        assert [(p - base, n) for p, n in runtime.calls] == [(0, 1_536_000), (1_536_000, 1_536_000),
                                                            (3_072_000, 1_536_000), (4_608_000, 1_392_000)]  # fmt: skip
        assert runtime.last_error == 0  # no chunk touched a page another had locked
        registration.release()
        assert runtime.locked == {}
    finally:
        seg.close()


def test_a_failed_registration_unregisters_what_was_locked(tmp_path, monkeypatch):
    rt = PageLockingRuntime(fail_call=3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    seg = SharedSegment.open(SegmentInfo.for_engine(str(tmp_path), "pin", world_size=2, shard_bytes=3000,
                                                    num_slots=1000))  # fmt: skip
    try:
        with pytest.raises(PinningError, match="shared CPU tier segment"):
            _pin(seg, None, 1 << 20)
        assert rt.locked == {} and rt.last_error == 0
    finally:
        seg.close()
