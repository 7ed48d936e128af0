"""The calls-in-flight bench (issue 46, item 1): its rows' structure and sanity on the host engine, and how the
GPU section judges them against the DMAs and the issue's targets (fed rows, so it runs without CUDA)."""

from __future__ import annotations

import math

import pytest

from tiered_kv.bench.gpu import judge_inflight
from tiered_kv.bench.inflight import bench_inflight


def _finite(s: dict) -> None:
    assert all(math.isfinite(s[k]) for k in ("median", "q1", "q3", "lo", "hi"))
    assert s["lo"] <= s["q1"] <= s["median"] <= s["q3"] <= s["hi"]


@pytest.mark.slow
def test_one_and_n_calls_in_flight_both_ways_and_the_host_split_on_the_host_engine():
    rows = bench_inflight(block_sizes=(16 << 10,), depths=(1, 2), rounds=3)
    assert [(r["op"], r["inflight"]) for r in rows] == [("store", 1), ("store", 2), ("load", 1), ("load", 2), ("both", 2)]
    for r in rows:
        assert r["block_bytes"] == 16 << 10 and r["regions"] == 8 and r["copy_path"] == "host-rows"
        _finite(r["ratio"])
        assert r["ratio"]["lo"] > 0
    for r in rows[:-1]:
        assert r["rounds"] == 3 and r["ratio"]["n"] == 3 and r["raw_method"]
        for key in ("raw_gbps", "ours_gbps"):
            _finite(r[key])
        h = r["host_us"]
        for part in ("whole", "engine", "cache"):
            _finite(h[part])
        # The engine's share was seen (the host engine's entry points were timed) and is part of the whole.
        assert 0 < h["engine"]["median"] and h["whole"]["median"] > 0
        assert h["cache"]["median"] == pytest.approx(h["whole"]["median"] - h["engine"]["median"], abs=0.5 * h["whole"]["median"])
        # Runs of slots were counted from the calls the engine got: at least one per call, at most a block each.
        assert 1 <= r["slot_runs"]["lo"] <= r["slot_runs"]["hi"] <= 64 and r["slot_runs"]["n"] == 3 * r["inflight"]
    both = rows[-1]
    for key in ("store_alone_s", "load_alone_s", "both_s", "overlap"):
        _finite(both[key])
    # The pair against the two alone back to back: no bench of two copies makes them 3x slower or 3x faster.
    assert 0.33 < both["overlap"]["median"] < 3
    # Two copies that ran one after another give 1.0: a pair far slower than that means the bench broke.
    assert 0.2 < both["ratio"]["median"] < 2.5


def _row(op: str, block: int, n: int, gbps: float) -> dict:
    s = {"median": gbps}
    return {"op": op, "block_bytes": block, "inflight": n, "ours_gbps": s,
            "host_us": {"whole": {"median": 140.0}, "engine": {"median": 70.0}, "cache": {"median": 70.0}}}  # fmt: skip


def test_the_gpu_section_judges_each_row_against_the_dmas_and_the_issue_targets():
    link = {"d2h": 50.0, "h2d": 54.0}
    peaks = {2 << 20: {"d2h": 50.0, "h2d": 50.0}, 256 << 10: {"d2h": 40.0, "h2d": 40.0},
             16 << 10: {"d2h": 20.0, "h2d": 25.0}}  # fmt: skip
    rows = judge_inflight([
        _row("store", 2 << 20, 1, 46.0), _row("load", 2 << 20, 4, 46.0), _row("store", 256 << 10, 1, 20.0),
        _row("store", 256 << 10, 2, 37.0), _row("load", 16 << 10, 8, 18.0), _row("store", 16 << 10, 4, 18.0),
        {"op": "both", "block_bytes": 2 << 20, "inflight": 2, "ratio": {"median": 1.5}},
    ], link, peaks)  # fmt: skip
    one, four, small1, small2, tiny8, tiny4, both = rows
    assert (one["of_dma"], one["of_link"], one["target_min"], one["meets_target"]) == (0.92, 0.92, 0.9, True)
    assert (four["target_min"], four["meets_target"]) == (0.95, False)  # 2+ in flight: the higher bar
    assert "target_min" not in small1  # 256 KiB has a target at 2 or more in flight only
    assert (small2["of_dma"], small2["target_min"], small2["meets_target"]) == (0.925, 0.9, True)
    # 16 KiB: judged against the link (its own 1 MiB DMA is slow), from 8 in flight up.
    assert (tiny8["of_link"], tiny8["of_dma"], tiny8["target_of"], tiny8["meets_target"]) == (0.333, 0.72, "of_link", True)
    assert "target_min" not in tiny4
    assert (both["target_min"], both["meets_target"]) == (1.6, False)
    assert one["host_meets_target"] is False  # engine 70 us > 60
