"""The dispatcher's two doors over one budget (start_nowait / run), its routes, and the slab's restage handler."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tiered_kv.byte_budget import ByteBudget
from tiered_kv.errors import TransferError
from tiered_kv.manager import LoadPlan, SpillJob, StorePlan
from tiered_kv.media import CPU_TO_DISK, CPU_TO_GPU, DISK_TO_CPU, GPU_TO_CPU, RESTAGE
from tiered_kv.metrics import CacheMetrics
from tiered_kv.transfer.handlers import CopyJob, Dispatcher, WouldBlock, register_slab
from tiered_kv.transfer.runners.control import Outcome

BPB = 64


def dispatcher(limit: int = 1 << 20) -> tuple[Dispatcher, ByteBudget, CacheMetrics]:
    budget, metrics = ByteBudget(limit), CacheMetrics()
    return Dispatcher(budget, metrics, BPB), budget, metrics


def moved(metrics: CacheMetrics, direction: str) -> float:
    return metrics.snapshot().get(f"tiered_kv_blocks_moved_total{{{direction}}}", 0.0)


async def ones(job) -> np.ndarray:
    return np.ones(len(job), dtype=bool)


def job(n: int = 4, route=GPU_TO_CPU) -> CopyJob:
    return CopyJob(route, np.arange(n), np.arange(n))


def test_the_directions_are_the_registered_routes():
    d, _, _ = dispatcher()
    assert d.directions == {}
    d.register(CPU_TO_DISK, ones)
    d.register(DISK_TO_CPU, ones)
    assert d.directions == {CPU_TO_DISK: "cpu_to_disk", DISK_TO_CPU: "disk_to_cpu"}
    assert d.handles(CPU_TO_DISK) and not d.handles(GPU_TO_CPU)
    with pytest.raises(TransferError, match="Route"):
        d.register(("cpu", "disk"), ones)


async def test_an_inline_start_lands_within_the_call_and_holds_no_budget():
    d, budget, metrics = dispatcher()
    calls = []
    d.register(GPU_TO_CPU, ones, inline=lambda j: calls.append(len(j)) or True)
    out = Outcome(asyncio.get_running_loop())
    assert d.start_nowait(job(4), lambda error: calls.append(error), out) is True
    assert calls == [4] and budget.used == 0 and moved(metrics, "gpu_to_cpu") == 4
    with pytest.raises(WouldBlock):  # off the loop: never inline, and nothing to hand off to
        d.start_nowait(job(4), lambda error: calls.append(error), Outcome())
    assert calls == [4] and budget.used == 0


async def test_a_declined_inline_copy_is_handed_off_with_the_callers_future():
    d, budget, _ = dispatcher()
    handed = []
    d.register(GPU_TO_CPU, ones, inline=lambda j: False, hand_off=lambda j, done, out: handed.append(out()))
    out = Outcome(asyncio.get_running_loop())
    assert d.start_nowait(job(2), lambda error: None, out) is False
    assert handed == [out()] and isinstance(handed[0], asyncio.Future) and budget.used == 2 * BPB


def test_a_handed_off_start_holds_its_bytes_until_it_lands():
    d, budget, metrics = dispatcher()
    started, ended = [], []
    d.register(CPU_TO_GPU, ones, hand_off=lambda j, done, out: started.append(done))
    assert d.start_nowait(job(3, CPU_TO_GPU), ended.append, Outcome()) is False
    assert budget.used == 3 * BPB and moved(metrics, "cpu_to_gpu") == 0 and ended == []
    assert metrics.snapshot()["tiered_kv_inflight_bytes"] == 3 * BPB  # the gauge reads the budget when scraped
    started[0](None)
    assert budget.used == 0 and moved(metrics, "cpu_to_gpu") == 3 and ended == [None]
    assert metrics.snapshot()["tiered_kv_inflight_bytes"] == 0


def test_would_block_starts_nothing_and_takes_nothing():
    d, budget, _ = dispatcher(limit=4 * BPB)
    started = []
    d.register(GPU_TO_CPU, ones, hand_off=lambda j, done, out: started.append(j))
    assert budget.take_now(2 * BPB)  # another copy in flight: 4 more blocks do not fit
    with pytest.raises(WouldBlock):
        d.start_nowait(job(4), lambda error: None, Outcome())
    assert started == [] and budget.used == 2 * BPB

    def declines(j, done, out):
        raise WouldBlock

    d.register(GPU_TO_CPU, ones, hand_off=declines)
    with pytest.raises(WouldBlock):
        d.start_nowait(job(1), lambda error: None, Outcome())
    assert budget.used == 2 * BPB  # what the declined start took is back
    d.register(CPU_TO_GPU, ones)  # no starter: the awaited door only
    with pytest.raises(WouldBlock):
        d.start_nowait(job(1, CPU_TO_GPU), lambda error: None, Outcome())


def test_restaged_rows_go_through_their_handler_and_count_no_move():
    d, _, metrics = dispatcher()
    slab = np.arange(8 * BPB, dtype=np.uint8).reshape(8, BPB)
    before = slab.copy()
    register_slab(d, slab, BPB)
    ok = asyncio.run(d.run(CopyJob(RESTAGE, np.array([0, 2]), np.array([6, 7]))))
    assert ok.all() and (slab[6] == before[0]).all() and (slab[7] == before[2]).all()
    assert "tiered_kv_blocks_moved_total{cpu_to_cpu}" not in metrics.snapshot()


def test_a_plan_says_whether_it_must_wait():
    empty = np.zeros(0, dtype=np.int64)
    plan = StorePlan([b"k" * 16], np.array([0]), np.array([1]))
    assert not plan.must_wait
    plan.spill = SpillJob(np.zeros((1, 16), np.uint8), np.array([1]), np.array([0]), reuse=True)
    assert plan.must_wait and plan.spill.media is CPU_TO_DISK
    assert StorePlan([], empty, empty).must_wait is False
    assert not LoadPlan(np.array([3])).must_wait
    assert LoadPlan(np.array([3]), restage=(np.array([3]), np.array([9]))).must_wait
