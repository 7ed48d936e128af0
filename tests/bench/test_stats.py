"""The bench's statistics: medians with their spread, paired ratios, the raw-slower flag, interleaving."""

from __future__ import annotations

import asyncio

import pytest

from tiered_kv.bench.stats import RAW_SLOWER_LIMIT, Spread, compare, fastest, interleave
from tiered_kv.errors import TieredKVError


def test_spread_gives_median_quartiles_and_extremes():
    s = Spread.of([9, 1, 5, 3, 7, 2, 8, 4, 6])
    assert (s.median, s.q1, s.q3, s.lo, s.hi, s.n) == (5, 3, 7, 1, 9, 9)
    assert Spread.of([2.5]).as_dict() == {"median": 2.5, "q1": 2.5, "q3": 2.5, "lo": 2.5, "hi": 2.5, "n": 1}
    with pytest.raises(TieredKVError):
        Spread.of([])


def test_ratio_is_taken_per_round_not_from_the_medians():
    # The machine slows down 10x and 100x between rounds; each pair still says ours runs at half speed.
    raw = [1.0, 10.0, 100.0]
    ours = [2.0, 20.0, 200.0]
    out = compare(raw, ours, nbytes=10**9)
    assert out["ratio"]["median"] == pytest.approx(0.5)
    assert out["ratio"]["lo"] == out["ratio"]["hi"] == pytest.approx(0.5)
    assert out["rounds"] == 3
    assert out["raw_gbps"]["median"] == pytest.approx(0.1)  # 1 GB in 10 s
    assert out["ours_gbps"]["hi"] == pytest.approx(0.5) and out["ours_gbps"]["lo"] == pytest.approx(0.005)
    assert "warning" not in out


def test_raw_slower_than_ours_is_flagged_not_reported_silently():
    ok = compare([1.0] * 9, [1.0 / RAW_SLOWER_LIMIT] * 9)  # exactly at the limit: still believable
    assert "warning" not in ok
    bad = compare([2.0] * 9, [1.0] * 9)
    assert bad["ratio"]["median"] == pytest.approx(2.0)
    assert "raw reference slower than ours" in bad["warning"] and "2.00" in bad["warning"]
    # A bar that is not meant to be the fastest way (a dict loop for lookup) is never flagged.
    assert "warning" not in compare([2.0] * 9, [1.0] * 9, raw_is_fastest=False)


def test_compare_refuses_unpaired_or_empty_samples():
    with pytest.raises(TieredKVError, match="paired"):
        compare([1.0, 2.0], [1.0])
    with pytest.raises(TieredKVError, match="positive"):
        compare([1.0], [0.0])


def test_interleave_alternates_sides_and_drops_the_warmup():
    calls: list[tuple[str, int]] = []

    def sampler(name: str, base: float):
        async def run(i: int) -> float:
            calls.append((name, i))
            return base + i

        return run

    raw_s, ours_s = asyncio.run(
        interleave({"a": sampler("a", 100.0), "b": sampler("b", 200.0)}, sampler("ours", 0.0), rounds=3, warmup=1)
    )
    # Every round runs each side once; who goes first rotates, so no side always follows the same one.
    assert calls == [("ours", 0), ("a", 0), ("b", 0),
                     ("a", 1), ("b", 1), ("ours", 1),
                     ("b", 2), ("ours", 2), ("a", 2),
                     ("ours", 3), ("a", 3), ("b", 3)]  # fmt: skip
    assert ours_s == [1.0, 2.0, 3.0]  # round 0 was the warm-up
    assert raw_s == {"a": [101.0, 102.0, 103.0], "b": [201.0, 202.0, 203.0]}


def test_fastest_picks_the_lowest_median():
    assert fastest({"steady": [2.0, 2.0, 2.0], "erratic": [0.5, 9.0, 9.0], "quick": [1.0, 1.5, 30.0]}) == "quick"


def test_a_sample_runs_with_the_cyclic_gc_paused_and_restored():
    import gc

    from tiered_kv.bench.stats import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():  # restored on the way out of a failing sample too
        raise ValueError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own choice is left as it was
    finally:
        gc.enable()
