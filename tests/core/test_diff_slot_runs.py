"""The store metrics' runs count (native/rows.hpp count_runs, bound as core.slot_runs) against a plain
Python reference: sort, then count the places where the next slot is not one more than the last."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.core import core
from tiered_kv.errors import SlotError

EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "60"))


def reference_runs(slots: list[int]) -> int:
    ordered = sorted(slots)
    return sum(1 for i, s in enumerate(ordered) if i == 0 or s != ordered[i - 1] + 1)


@settings(max_examples=4 * EXAMPLES, deadline=None)
@given(st.lists(st.integers(0, 300), unique=True, max_size=200), st.randoms(use_true_random=False))
def test_native_runs_count_matches_the_reference_in_any_order(slots, rnd):
    rnd.shuffle(slots)
    assert core.slot_runs(np.array(slots, dtype=np.int64)) == reference_runs(slots)


def test_other_integer_arrays_and_lists_count_alike_and_two_dims_are_refused():
    assert core.slot_runs(np.array([4, 2, 3, 9], dtype=np.int32)) == core.slot_runs([9, 3, 4, 2]) == 2
    assert core.slot_runs(np.zeros(0, dtype=np.int64)) == 0
    with pytest.raises(SlotError, match="1-D integers, got int64 of 2 dims"):
        core.slot_runs(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(SlotError, match="got float64"):  # never cast: 0.5 and 1.5 are not slots
        core.slot_runs(np.array([0.5, 1.5]))
    with pytest.raises(SlotError, match="got bool"):
        core.slot_runs([True, False])
    view = np.arange(10, dtype=np.int64)[::3]  # a strided view counts as its values: 0 3 6 9
    assert core.slot_runs(view) == 4 and view.tolist() == [0, 3, 6, 9]  # and is left as it was
