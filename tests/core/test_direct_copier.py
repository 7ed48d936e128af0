"""The direct road's native submit and completion over the fake driver (native/direct_copy.hpp, issue 46).

CPU tensors stand in for GPU memory; the fake's streams run on the host and a test holds them to decide
when events complete. The asyncio side (tiered_kv/transfer/engines/direct.py) is tested in tests/unit.
"""

from __future__ import annotations

import select

import numpy as np
import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import TransferError

fake = core.fake_cuda
ROW = 4096


def rig(num_blocks=16, num_slots=12, version=13000, dma_rows=0):
    gen = torch.Generator().manual_seed(num_blocks * 31 + num_slots)
    gpu = torch.randint(0, 256, (num_blocks, ROW), dtype=torch.uint8, generator=gen)
    cpu = torch.zeros((num_slots, ROW), dtype=torch.uint8)
    regions = [(gpu.data_ptr(), ROW, ROW, cpu.data_ptr(), ROW, 0)]
    return core.DirectCopier(f"fake:{version}", 0, regions, num_blocks, num_slots, dma_rows), gpu, cpu


def wait_for(copier, direction, seq, timeout=5.0):
    done = copier.poll()
    while done[direction] < seq:
        assert select.select([copier.fd], [], [], timeout)[0], f"no completion of call {seq} within {timeout} s"
        done = copier.poll()
    return done


@pytest.fixture(autouse=True)
def no_leaks():
    before = fake.live()
    yield
    assert fake.live() == before, "a test left fake events or streams behind"


@pytest.mark.parametrize("version", [13000, 12080, 12000])
def test_round_trip_with_each_driver_abi(version):
    copier, gpu, cpu = rig(version=version)
    fake.reset_counts()
    seq = copier.submit(0, np.array([3, 4, 5, 9]), np.array([0, 1, 2, 7]))
    wait_for(copier, 0, seq)
    for s, b in zip([0, 1, 2, 7], [3, 4, 5, 9], strict=True):
        assert torch.equal(cpu[s], gpu[b])
    gpu[3:6] = 0
    seq = copier.submit(1, np.array([0, 1, 2]), np.array([3, 4, 5]))
    wait_for(copier, 1, seq)
    assert torch.equal(gpu[3], cpu[0]) and torch.equal(gpu[5], cpu[2])
    counts = fake.counts()
    assert counts.get("batch", 0) == (2 if version >= 12080 else 0)
    assert counts.get("memcpy", 0) == (0 if version >= 12080 else 3)  # 2 runs, then 1: one copy per run
    assert counts["record"] == 2 and counts.get("wait", 0) == 0
    copier.close()


def test_the_copy_waits_for_the_ready_event():
    copier, gpu, cpu = rig()
    compute, ready = fake.stream_create(), fake.event_create()
    fake.hold(compute)
    fake.record(ready, compute)  # the "model" has not reached its event yet
    seq = copier.submit(0, np.array([1]), np.array([0]), 1, ready)
    assert not cpu[0].any() and copier.poll()[0] == 0
    fake.hold(compute, False)
    wait_for(copier, 0, seq)
    assert torch.equal(cpu[0], gpu[1])
    # A stream instead of an event: the copier records its own ready event on it.
    fake.hold(compute)
    seq = copier.submit(0, np.array([2]), np.array([1]), 2, compute)
    assert not cpu[1].any()
    fake.hold(compute, False)
    wait_for(copier, 0, seq)
    assert torch.equal(cpu[1], gpu[2])
    copier.close()
    fake.event_destroy(ready)
    fake.stream_destroy(compute)


def test_completions_arrive_in_fifo_order():
    copier, gpu, cpu = rig()
    stream = copier.stream(0)
    fake.hold(stream)
    seqs = [copier.submit(0, np.array([i]), np.array([i])) for i in range(3)]
    assert seqs == [1, 2, 3] and copier.poll()[0] == 0
    for expect in (1, 2, 3):
        fake.step(stream, 1)
        assert wait_for(copier, 0, expect)[0] == expect
        assert torch.equal(cpu[expect - 1], gpu[expect - 1]) and not cpu[expect:3].any()
    fake.hold(stream, False)
    copier.close()


def test_a_failed_batch_is_reported_when_its_done_event_completes():
    copier, *_tensors = rig()  # held: the copier's regions point into them
    fake.fail_batches(1)
    seq = copier.submit(0, np.array([1, 2]), np.array([0, 1]))
    store, _, errors = wait_for(copier, 0, seq)
    assert errors == [(0, seq, "cuMemcpyBatchAsync of 1 copies failed with CUresult 1")]
    assert copier.poll()[2] == []  # reported once
    copier.close()


def test_refused_calls_queue_nothing_and_close_is_final():
    copier, *_tensors = rig()  # held: the copier's regions point into them
    fake.reset_counts()
    with pytest.raises(TransferError, match="duplicate cpu slot 3 in one batch"):
        copier.submit(0, [1, 2], [3, 3])
    with pytest.raises(TransferError, match="gpu block id 16 out of range"):
        copier.submit(1, [0], [16])
    with pytest.raises(TransferError, match="cuStreamWaitEvent failed with CUresult 400"):
        copier.submit(0, [1], [1], 1, 0xDEAD)  # not an event: the fake refuses the handle, nothing queued
    assert fake.counts().get("batch", 0) == 0 and copier.submits == 0
    copier.close()
    copier.close()
    assert copier.closed and copier.fd == -1
    with pytest.raises(TransferError, match="after close"):
        copier.submit(0, [1], [1])
