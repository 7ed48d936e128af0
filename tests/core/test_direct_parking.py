"""The native copier's calls in flight (native/direct_copy.hpp, issue 46 item 5) over the fake driver:
at most max_inflight issued per direction, later ones parked and issued by the completion thread; a
native wait with the GIL released; close() drains parked calls and joins its threads."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import TransferError

fake = core.fake_cuda
ROW = 1024


@pytest.fixture(autouse=True)
def no_leaks():
    before = fake.live()
    yield
    assert fake.live() == before, "a test left fake events or streams behind"


@contextlib.contextmanager
def holding(copier, stream):
    """Hold a copy stream; on the way out (an assertion failed too) release it and close the copier, so a
    failing test fails instead of hanging in close()."""
    fake.hold(stream)
    try:
        yield
    finally:
        fake.hold(stream, False)
        copier.close()


def rig(max_inflight):
    gpu = torch.randint(1, 256, (16, ROW), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    cpu = torch.zeros((16, ROW), dtype=torch.uint8)
    regions = [(gpu.data_ptr(), ROW, ROW, cpu.data_ptr(), ROW, 0)]
    return core.DirectCopier("fake:13000", 0, regions, 16, 16, 0, max_inflight), gpu, cpu


def test_parked_calls_are_issued_in_order_as_slots_free_and_waited_for_natively():
    copier, gpu, cpu = rig(2)
    stream = copier.stream(0)
    with holding(copier, stream):
        parked_then_issued(copier, stream, gpu, cpu)


def parked_then_issued(copier, stream, gpu, cpu) -> None:
    fake.reset_counts()
    seqs = [copier.submit(0, np.array([i]), np.array([i])) for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5] and copier.inflight(0) == (2, 3) and copier.inflight(1) == (0, 0)
    assert fake.counts()["batch"] == 2
    assert not copier.wait(0, 1, 0.05), "a held call reported complete"
    fake.step(stream, 1)
    assert copier.wait(0, 1, 5) and not copier.wait(0, 2, 0.02)
    assert copier.inflight(0) == (2, 2) and fake.counts()["batch"] == 3  # call 3 took call 1's slot
    assert not cpu[3:5].any()
    releaser = threading.Timer(0.05, fake.hold, (stream, False))
    releaser.start()
    start = time.monotonic()
    assert copier.wait(0, 5, 5)  # blocks without the GIL: the timer thread runs meanwhile
    assert time.monotonic() - start >= 0.04
    assert torch.equal(cpu[:5], gpu[:5]) and copier.poll()[0] == 5
    releaser.join()


def test_close_drains_parked_calls_and_joins_its_threads():
    copier, gpu, cpu = rig(1)
    stream = copier.stream(1)
    cpu[:4] = 7
    fake.hold(stream)
    releaser = threading.Timer(0.05, fake.hold, (stream, False))
    try:
        for i in range(4):
            copier.submit(1, np.array([i]), np.array([8 + i]))
        assert copier.inflight(1) == (1, 3)
        releaser.start()
        copier.close()  # returns once the parked calls were issued and landed
    finally:
        fake.hold(stream, False)
        copier.close()
        if releaser.ident is not None:
            releaser.join()
    assert bool((gpu[8:12] == 7).all()) and copier.closed


def test_a_bad_ready_handle_refuses_a_parked_call_too():
    copier, gpu, cpu = rig(1)  # the tensors stay alive: the held copies read and write them
    stream = copier.stream(0)
    with holding(copier, stream):
        copier.submit(0, np.array([1]), np.array([1]))
        with pytest.raises(TransferError, match="cuStreamWaitEvent failed with CUresult 400"):
            copier.submit(0, [2], [2], 1, 0xDEAD)  # snapshot refused: nothing parked, no sequence number taken
        assert copier.inflight(0) == (1, 0) and copier.submit(0, [3], [3]) == 2
        fake.hold(stream, False)
        assert copier.wait(0, 2, 5) and torch.equal(cpu[[1, 3]], gpu[[1, 3]])


def test_max_inflight_below_one_is_refused():
    with pytest.raises(TransferError, match="max_inflight must be at least 1, got 0"):
        rig(0)
