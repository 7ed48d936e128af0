"""The CPU tier's free-slot allocator (native/free_runs.hpp) against its reference (reference_core/free_runs.py),
and its own properties: slots come out ascending as the fewest runs the free slots allow, longest runs first;
no slot is handed out twice; the free count is exact; the runs stay maximal; giving back what a take handed
out restores the runs exactly; a tier's restore rebuilds them from any set of slots."""

from __future__ import annotations

import hashlib
import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_core.free_runs import FreeRuns as RefFreeRuns
from reference_core.free_runs import runs_of
from reference_core.twins import same, same_tier, tier_pair

from tiered_kv.core import core
from tiered_kv.errors import TieredKVError

EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "60"))
KB = 16
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def runs_in(slots) -> list[tuple[int, int]]:
    """The runs of consecutive slots a sorted batch forms, as (start, length)."""
    out: list[tuple[int, int]] = []
    for s in slots:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


def fewest_runs(lengths: list[int], m: int) -> int:
    """The fewest free runs whose slots add up to at least m."""
    total = k = 0
    for n in sorted(lengths, reverse=True):
        if total >= m:
            break
        total += n
        k += 1
    return k


def check_take(before: list[tuple[int, int]], got: list[int], m: int) -> None:
    """``got`` (a take of m from free runs ``before``) is ascending, distinct, free, as few runs as can be,
    and every run it takes whole is among the longest."""
    assert got == sorted(set(got)) and len(got) == m
    free = {s for start, n in before for s in range(start, start + n)}
    assert set(got) <= free, "handed out a slot that was not free"
    pieces = runs_in(got)
    assert len(pieces) == fewest_runs([n for _, n in before], m), (before, m, pieces)
    longest = sorted((n for _, n in before), reverse=True)[: len(pieces) - 1]
    # All but one piece (the best fit for what remained, cut or not) are whole runs, the longest ones.
    assert any(
        all(p in before for p in others) and sorted((n for _, n in others), reverse=True) == longest
        for others in (pieces[:i] + pieces[i + 1 :] for i in range(len(pieces)))
    ) or not pieces, (before, m, pieces)


ops = st.lists(st.tuples(st.sampled_from(["take", "give", "undo"]), st.integers(0, 40), st.randoms()), max_size=40)


@SETTINGS
@given(n=st.integers(0, 48), steps=ops)
def test_free_runs_match_the_reference_and_keep_their_properties(n: int, steps) -> None:
    nat, ref = core.FreeRuns(n), RefFreeRuns(n)
    held: list[int] = []  # handed out and not given back
    for op, k, rnd in steps:
        before = [tuple(r) for r in nat.runs().tolist()]
        if op in ("take", "undo"):
            m = min(k, nat.count)
            got = nat.take(m)
            same(ref.take(m), got, "take")
            check_take(before, got.tolist(), m)
            assert not set(got.tolist()) & set(held), "a slot handed out twice"
            if op == "undo":  # given straight back: the runs are as the take found them
                nat.give(got)
                ref.give(got)
                assert [tuple(r) for r in nat.runs().tolist()] == before
            else:
                held += got.tolist()
        else:
            back = rnd.sample(held, min(k, len(held)))
            nat.give(np.array(back, dtype=np.int64))
            ref.give(back)
            held = [s for s in held if s not in set(back)]
            if held and back:  # a slot that is free already, or a repeat: refused whole, nothing changes
                runs = nat.runs().tolist()
                for bad in ([held[0], back[0]], [held[0], held[0]]):
                    with pytest.raises(TieredKVError):
                        nat.give(np.array(bad, dtype=np.int64))
                    assert nat.runs().tolist() == runs
        nat.check_invariants()
        runs = [tuple(r) for r in nat.runs().tolist()]
        same([tuple(r) for r in ref.runs()], runs, "runs")
        assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False)), "runs not maximal"
        assert nat.count == ref.count == n - len(held) == sum(r[1] for r in runs)
        assert nat.num_runs == len(runs) and nat.nbytes == ref.nbytes


def test_free_runs_refuse_bad_batches_whole() -> None:
    f = core.FreeRuns(8)
    got = f.take(5)
    assert got.tolist() == [0, 1, 2, 3, 4] and f.runs().tolist() == [[5, 3]]
    for bad in ([1, 1], [0, 5], [9], [-1], [0, 1, 2, 3, 4, 5, 6, 7, 8]):
        with pytest.raises(TieredKVError):
            f.give(np.array(bad, dtype=np.int64))
        assert f.runs().tolist() == [[5, 3]] and f.count == 3
    with pytest.raises(TieredKVError):
        f.take(4)
    f.give(np.array([1, 3], dtype=np.int64))
    assert f.runs().tolist() == [[1, 1], [3, 1], [5, 3]]
    assert f.take(2).tolist() == [5, 6]  # best fit for 2 is the run of 3 (no run of exactly 2)
    assert f.take(2).tolist() == [1, 3]  # the longest runs, lowest start first (two of length 1)
    f.check_invariants()


def test_a_full_tier_holds_no_free_run_and_a_fragmented_one_pays_per_run() -> None:
    """Memory per free run, none per slot (the 1M-block memory target is measured on a full tier)."""
    keys = [hashlib.sha256(b"m%d" % i).digest()[:KB] for i in range(1024)]
    ref, nat = tier_pair("t", 1024, KB, "lru")
    empty = nat.core_nbytes
    for t in (ref, nat):
        t.commit(t.reserve(keys))
    full = nat.core_nbytes
    assert nat.free_count == 0 and nat.free_runs().shape == (0, 2) and empty - full == 96
    for t in (ref, nat):
        t.drop(np.arange(0, 1024, 2, dtype=np.int64))
    same_tier(ref, nat)
    assert nat.free_runs().shape == (512, 2) and nat.core_nbytes - full == 512 * 96


@SETTINGS
@given(n=st.integers(1, 40), data=st.data())
def test_restore_rebuilds_the_runs_after_any_sequence(n: int, data) -> None:
    ref, nat = tier_pair("t", n, KB, "lru")
    fresh = (hashlib.sha256(b"r%d" % i).digest()[:KB] for i in itertools.count())
    for _ in range(data.draw(st.integers(0, 8))):  # reserve / commit / abort / drop, as a running tier does
        m = data.draw(st.integers(0, n))
        batch = [next(fresh) for _ in range(m)]
        got = nat.reserve(batch)
        same(ref.reserve(batch), got, "reserve")
        k = data.draw(st.integers(0, len(got)))
        for t in (ref, nat):
            t.abort(got[k:])
            t.commit(got[:k])
        ready = np.flatnonzero(nat.state == 2)
        gone = data.draw(st.lists(st.sampled_from(ready.tolist()), unique=True)) if len(ready) else []
        for t in (ref, nat):
            t.drop(np.array(gone, dtype=np.int64))
        same_tier(ref, nat)
    for t in (ref, nat):  # empty it, then restore any set of slots
        t.drop(np.flatnonzero(t.state == 2))
    slots = data.draw(st.lists(st.integers(0, n - 1), unique=True))
    back = [next(fresh) for _ in slots]
    for t in (ref, nat):
        t.restore(back, np.array(slots, dtype=np.int64))
    used = np.zeros(n, dtype=bool)
    used[slots] = True
    assert [tuple(r) for r in nat.free_runs().tolist()] == runs_of(~used)
    same_tier(ref, nat)
    m = data.draw(st.integers(0, n))
    batch = [next(fresh) for _ in range(m)]
    before = [tuple(r) for r in nat.free_runs().tolist()]
    got = nat.reserve(batch)
    same(ref.reserve(batch), got, "reserve after restore")
    check_take(before, got.tolist(), min(m, len(before) and sum(r[1] for r in before)))
    same_tier(ref, nat)
