"""Pinning the CPU tier, shown on the CPU: page alignment, the chunk arithmetic, registration
through a page-granular stand-in for CUDA's runtime, and a low memlock limit that only warns."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fake_cudart import PAGE, PageLockingRuntime
from hypothesis import given, settings
from hypothesis import strategies as st

import tiered_kv as tkv
from tiered_kv.tiers.cpu import CpuSlabs

MiB = 1 << 20


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch sees CUDA, and its runtime is the page-granular stand-in (the only thing replaced is torch's)."""
    runtime = PageLockingRuntime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    return runtime


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB + 300, 16 * MiB])
def test_the_slab_starts_on_a_page(nbytes):
    # torch's allocator puts large buffers 64 bytes past a page boundary.
    layout = tkv.KVLayout.from_block_bytes([nbytes // 4, nbytes - nbytes // 4], num_blocks=4)
    slabs = CpuSlabs(layout, 1, pin="off")
    assert slabs.slab.data_ptr() % PAGE == 0 and slabs.nbytes == nbytes
    slabs.slab.fill_(1)  # the whole slab is ours
    assert int(slabs.slab.sum()) == nbytes


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 34), st.integers(1, 1 << 22), st.integers(1, 1 << 31), st.sampled_from([4096, 16384, 65536]))
def test_pin_chunks_tile_the_slab_on_page_and_row_edges(nbytes, row_bytes, chunk, page):
    from tiered_kv.tiers.pinning import pin_chunks

    chunks = pin_chunks(nbytes, row_bytes, chunk, page)
    unit = math.lcm(page, row_bytes)
    pos = 0
    for offset, size in chunks:
        assert offset == pos and size > 0  # in order, no gap, no overlap
        assert offset % page == 0 and offset % row_bytes == 0
        pos += size
    assert pos == nbytes
    for _, size in chunks[:-1]:  # every chunk but the last: whole pages and rows, at most the request
        assert size % unit == 0 and size <= max(chunk, unit)
    assert len(chunks) <= 1 or chunks[0][1] == max(unit, chunk // unit * unit)


@pytest.mark.parametrize("widths", [(8192, 4096, 4096), (8192, 4096, 1024), (4096, 300, 2048)])
def test_chunked_pinning_registers_disjoint_pages_and_reports_row_chunks(fake_cuda, widths):
    layout = tkv.KVLayout.from_block_bytes(list(widths), num_blocks=4)
    bpb = layout.bytes_per_block
    slots = -(-4 * MiB // bpb)  # a slab of >= 4 MiB in chunks of ~1 MiB (more when a row's lcm with a page is)
    slabs = CpuSlabs(layout, slots, pin="on", pin_chunk=MiB)
    try:
        assert slabs.pinned
        base = slabs.slab.data_ptr()
        unit = math.lcm(PAGE, bpb)
        offsets = [ptr - base for ptr, _ in fake_cuda.calls]
        assert offsets[0] == 0 and sum(size for _, size in fake_cuda.calls) == slabs.nbytes
        assert all(o % unit == 0 for o in offsets)
        if len(offsets) > 1:
            assert slabs.dma_rows == fake_cuda.calls[0][1] // bpb
        else:
            assert slabs.dma_rows is None and unit > MiB
        assert fake_cuda.last_error == 0
    finally:
        slabs.release()
    assert not slabs.pinned and fake_cuda.locked == {}


def test_a_failed_registration_unpins_everything_and_clears_the_cuda_error(fake_cuda):
    fake_cuda.fail_call = 3
    layout = tkv.KVLayout.from_block_bytes([4096, 4096], num_blocks=4)
    with pytest.raises(tkv.PinningError, match=r"cudaHostRegister of 1048576 bytes \(offset 2097152 .*CUDA "
                                               r"error 2.*RLIMIT_MEMLOCK is .*pin_memory: off"):  # fmt: skip
        CpuSlabs(layout, 512, pin="on", pin_chunk=MiB)
    assert fake_cuda.locked == {}, "the chunks pinned before the failure stay registered"
    assert fake_cuda.last_error == 0, "the failed call's error is left pending for the next torch CUDA call"


def test_a_low_memlock_limit_warns_and_pinning_goes_ahead(tmp_path):
    # Docker's default RLIMIT_MEMLOCK is 64 KiB; the driver's pinning is not charged to it.
    script = textwrap.dedent(f"""
        import logging, resource, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from fake_cudart import PageLockingRuntime
        import tiered_kv as tkv
        from tiered_kv.tiers.cpu import CpuSlabs

        _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, hard))
        runtime = PageLockingRuntime()
        torch.cuda.is_available = lambda: True
        torch.cuda.cudart = lambda: runtime
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        slabs = CpuSlabs(tkv.KVLayout.from_block_bytes([65536], num_blocks=4), 64, pin="on", pin_chunk=1 << 20)
        assert slabs.pinned and len(runtime.locked) == 4, runtime.locked
        print("PINNED", slabs.nbytes)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PINNED 4194304" in proc.stdout
    assert "WARNING RLIMIT_MEMLOCK is 65536 bytes, below the CPU tier's 4194304" in proc.stderr
