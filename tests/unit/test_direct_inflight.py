"""Calls in flight on the direct road (issue 46 item 5) over the native fake CUDA driver.

At most ``max_inflight`` calls per direction are issued to the copy stream; later ones are parked in the
native copier with their readiness recorded at submit, and the completion thread issues them in order as
slots free. The fake's held streams are the gate: a held copy stream runs nothing until the test steps it.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import ConfigError
from tiered_kv.transfer.engines.base import Direction
from tiered_kv.transfer.engines.direct import DirectCopyEngine, RawHandle

fake = core.fake_cuda
NUM_BLOCKS, NUM_SLOTS, ROW = 24, 16, 2048


@pytest.fixture(autouse=True)
def no_leaks():
    before = fake.live()
    yield
    assert fake.live() == before, "an engine left fake events or streams behind"


def packed(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gpu = torch.randint(1, 256, (NUM_BLOCKS, ROW), dtype=torch.uint8, generator=gen)
    return [gpu], [torch.zeros(NUM_SLOTS, ROW, dtype=torch.uint8)]


@contextlib.contextmanager
def holding(*streams: int):
    """Hold the streams (the gate: nothing on them runs until stepped); released on the way out, also when an
    assertion failed, so the engine's aclose can drain instead of hanging."""
    for s in streams:
        fake.hold(s)
    try:
        yield
    finally:
        for s in streams:
            fake.hold(s, False)


async def settle(predicate, timeout: float = 2.0) -> None:
    """Yield to the loop until ``predicate()`` (completions arrive through the eventfd reader)."""
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def test_the_fifth_call_waits_for_a_free_slot_and_calls_finish_in_order():
    gpu, cpu = packed()
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", max_inflight=4) as engine:
        stream = engine.stream_handle(Direction.STORE)
        with holding(stream):
            fake.reset_counts()
            handles = [engine.submit_store([i], [i]) for i in range(6)]  # returns at once: the loop never blocks
            assert engine.queued(Direction.STORE) == (4, 2) and engine.inflight == 6
            counts = fake.counts()  # one batch and one done record per issued call, nothing for a parked one
            assert (counts["batch"], counts["record"], counts.get("wait", 0)) == (4, 4, 0)
            fake.step(stream, 1)  # the first call lands; its slot goes to the fifth at once (native thread)
            await asyncio.wait_for(handles[0], 2)
            await settle(lambda: engine.queued(Direction.STORE) == (4, 1))
            assert fake.counts()["batch"] == 5 and not cpu[0][4].any(), "the parked call ran before its turn"
            assert [h.done() for h in handles] == [True] + [False] * 5
            for k in range(1, 6):  # strictly in submission order
                fake.step(stream, 1)
                await asyncio.wait_for(handles[k], 2)
                assert [h.done() for h in handles] == [i <= k for i in range(6)]
            assert engine.queued(Direction.STORE) == (0, 0) and fake.counts()["batch"] == 6
        assert torch.equal(cpu[0][:6], gpu[0][:6])


async def test_each_direction_has_its_own_slots_and_stream():
    gpu, cpu = packed()
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", max_inflight=2) as engine:
        assert engine.stream_handle(Direction.STORE) != engine.stream_handle(Direction.LOAD)
        with holding(engine.stream_handle(Direction.STORE)):
            stores = [engine.submit_store([i], [i]) for i in range(3)]
            cpu[0][10] = 9
            await asyncio.wait_for(engine.submit_load([10], [20]), 2)  # not behind the held stores
            assert bool((gpu[0][20] == 9).all()) and engine.queued(Direction.STORE) == (2, 1)
        await asyncio.wait_for(asyncio.gather(*stores), 2)


async def test_a_parked_call_is_ordered_after_its_ready_event_as_recorded_at_submit():
    gpu, cpu = packed()
    compute, later, ready = fake.stream_create(), fake.stream_create(), fake.event_create()
    try:
        async with DirectCopyEngine(gpu, cpu, driver="fake:13000", max_inflight=1) as engine:
            stream = engine.stream_handle(Direction.STORE)
            with holding(later, compute, stream):
                first = engine.submit_store([0], [0])
                fake.record(ready, compute)  # the model's work this call must follow
                fake.reset_counts()
                parked = engine.submit_store([5], [5], compute=RawHandle(ready))
                counts = fake.counts()  # snapshot: a side stream waits for the event and records one of ours
                assert (counts["wait"], counts["record"], counts.get("batch", 0)) == (1, 1, 0)
                fake.record(ready, later)  # the caller reuses its event for work that never finishes here
                fake.hold(stream, False)
                await asyncio.wait_for(first, 2)
                await asyncio.sleep(0.05)
                assert not parked.done() and not cpu[0][5].any(), "the parked copy ran before its ready event"
                fake.hold(compute, False)  # what it waited for at submit is done; `later` is still held
                await asyncio.wait_for(parked, 2)
                assert torch.equal(cpu[0][5], gpu[0][5])
    finally:
        fake.event_destroy(ready)
        fake.stream_destroy(compute)
        fake.stream_destroy(later)


async def test_cancelling_the_wait_for_a_parked_call_leaves_the_copy_to_run():
    gpu, cpu = packed()
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", max_inflight=1) as engine:
        with holding(engine.stream_handle(Direction.LOAD)):
            cpu[0][3] = 5
            first = engine.submit_load([1], [1])
            parked = engine.submit_load([3], [7])
            task = asyncio.create_task(asyncio.wait_for(parked, 10))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not parked.future.cancelled() and engine.queued(Direction.LOAD) == (1, 1)
        await asyncio.wait_for(asyncio.gather(first, parked), 2)
        assert parked.future.exception() is None and bool((gpu[0][7] == 5).all())


async def test_aclose_drains_parked_calls():
    gpu, cpu = packed()
    live = fake.live()
    engine = DirectCopyEngine(gpu, cpu, driver="fake:12000", max_inflight=2)  # no batch call: a copy per run
    with holding(engine.stream_handle(Direction.STORE)):
        handles = [engine.submit_store([i], [i]) for i in range(5)]
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.02)
        assert not closing.done() and engine.queued(Direction.STORE) == (2, 3)
    await asyncio.wait_for(closing, 5)
    assert all(h.done() and h.future.exception() is None for h in handles)
    assert torch.equal(cpu[0][:5], gpu[0][:5]) and fake.live() == live


async def test_many_calls_through_few_slots_are_bit_exact():
    gpu, cpu = packed(3)
    rng = np.random.default_rng(4)
    async with DirectCopyEngine(gpu, cpu, driver="fake:13000", max_inflight=4) as engine:
        plans = [(rng.permutation(NUM_BLOCKS)[:3], np.arange(3 * k, 3 * k + 3)) for k in range(5)]
        await asyncio.gather(*(engine.submit_store(g, s) for g, s in plans))
        for g, s in plans:
            assert torch.equal(cpu[0][torch.as_tensor(s)], gpu[0][torch.as_tensor(g)])


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_inflight_must_be_a_positive_integer(bad):
    gpu, cpu = packed()
    with pytest.raises(ConfigError, match="max_inflight"):
        DirectCopyEngine(gpu, cpu, driver="fake:13000", max_inflight=bad)
