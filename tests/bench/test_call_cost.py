"""The call-cost bench (issue 46, item 7): a counted engine that moves nothing, a clock on the engine's entry
points, and rows whose figures are present, finite and add up (no absolute times)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from tiered_kv.bench.call_cost import PARTS, bench_call_cost
from tiered_kv.bench.counted import CountedEngine, SubmitClock
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.base import Direction


def _regions(rows: int = 16, width: int = 8) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gpu = [torch.arange(rows * width, dtype=torch.int64).to(torch.uint8).reshape(rows, width)]
    cpu = [torch.zeros((rows, width), dtype=torch.uint8)]
    return gpu, cpu


def test_the_counted_engine_completes_each_batch_without_moving_a_byte():
    async def go() -> CountedEngine:
        gpu, cpu = _regions()
        async with CountedEngine(gpu, cpu) as engine:
            await engine.submit_store([3, 1, 2], [5, 6, 7])
            await engine.submit_load([5, 6], [0, 1])
            assert engine.inflight == 0
            assert torch.count_nonzero(cpu[0]) == 0  # counted, not copied
            with pytest.raises(TransferError, match="out of range"):  # the ids are checked as every engine does
                engine.submit_store([99], [0])
            with pytest.raises(TransferError, match="duplicate"):
                engine.submit_load([1, 2], [4, 4])
        return engine

    engine = asyncio.run(go())
    assert engine.calls == {Direction.STORE: 1, Direction.LOAD: 1}
    assert engine.blocks == {Direction.STORE: 3, Direction.LOAD: 2}


def test_the_submit_clock_times_the_engine_and_counts_runs_of_slots_then_restores_it():
    async def go() -> SubmitClock:
        gpu, cpu = _regions()
        engine = CountedEngine(gpu, cpu)
        clock = SubmitClock(engine)
        await engine.submit_store([0, 1, 2, 3, 4, 5], [9, 2, 3, 1, 10, 12])  # sorted: 1-3, 9-10, 12: 3 runs
        await engine.submit_load(np.array([4, 5, 6, 7]), [0, 1, 2, 3])  # one run
        assert clock.calls == 2 and clock.take() > 0 and clock.take() == 0
        clock.restore()
        await engine.submit_store([0], [0])  # no longer counted
        assert clock.calls == 2
        await engine.aclose()
        return clock

    clock = asyncio.run(go())
    assert clock.slot_runs(Direction.STORE) == [3]
    assert clock.slot_runs(Direction.LOAD) == [1]


def _finite(s: dict) -> None:
    assert all(math.isfinite(s[k]) for k in ("median", "q1", "q3", "lo", "hi"))
    assert s["lo"] <= s["median"] <= s["hi"]


@pytest.mark.slow
def test_the_call_cost_rows_hold_every_figure_for_the_cpu_tier_and_a_disk_write_through(tmp_path):
    cases = (("cpu", "lru", None), ("disk", "window", "write_through"))
    rows = bench_call_cost(rounds=3, calls=4, cpu_calls=4, cases=cases, directory=str(tmp_path))
    assert [(r["op"], r["tier"], r["policy"]) for r in rows] == [
        ("store", "cpu", "lru"), ("load", "cpu", "lru"), ("store", "disk", "window"), ("load", "disk", "window")]  # fmt: skip
    for r in rows:
        assert r["batch"] == 64 and r["rounds"] == 3 and r["time_ratio"]["n"] == 3
        for key in ("raw_us", "ours_us", "engine_us", "cache_us", "time_ratio"):
            _finite(r[key])
        assert r["raw_us"]["lo"] > 0 and r["time_ratio"]["lo"] > 0
        # Every timed call reached the counted engine (4 per sample, 3 rounds + a warm-up, the profiled ones):
        # the figure is a call that did its copy's work, not one the cache answered without the engine.
        assert r["engine_calls"] >= 4 * 4
        assert r["slot_runs_per_call"]["lo"] >= 1
        parts = r["profile_us"]["parts"]
        assert set(parts) == {*PARTS, "runners+loop"} and all(v >= 0 for v in parts.values())
        assert parts["engine submit"] > 0 and parts["plan" if r["op"] == "store" else "args"] > 0
        # The parts are shares of the unprofiled figure: they add up to it unless the profile overclaims.
        assert sum(parts.values()) >= 0.99 * r["ours_us"]["median"]
        by_module = sum(r["profile_us"]["self_by_module"].values())  # the profiled self times: nearly the whole
        assert 0.8 * r["ours_us"]["median"] <= by_module <= 1.01 * r["ours_us"]["median"]
        # The second view, timed sections without a profiler: every section seen, the rest what they leave.
        sections = r["sections_us"]
        assert set(sections) == {"args", "plan", "commit", "metrics", "engine submit", "rest"}
        assert all(math.isfinite(v) for v in sections.values())
        assert sections["plan"] > 0 and sections["commit"] > 0 and sections["engine submit"] > 0
    for r in rows[:2]:  # the CPU tier's floor: the same manager and engine with no runner between
        assert 0 < r["floor_us"] and math.isfinite(r["floor_us"])
    assert "floor_us" not in rows[2]
    disk_store = rows[2]["profile_us"]["parts"]
    assert disk_store["disk (loop side)"] > 0  # write-through started its disk writes from these stores
    assert rows[0]["profile_us"]["parts"]["disk (loop side)"] < disk_store["disk (loop side)"]
