"""The engines' id check (transfer/engines/base.py check_id_arrays: one native pass, core.check_copy_ids, the
direct road's own check) against the numpy checks it replaced (reference_core/copy_ids.py): the same int64
arrays out, or a TransferError with the same message, for every input."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_core.copy_ids import check_copy_ids as reference

from tiered_kv.core import core
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.base import check_id_arrays

EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "60"))
NAMES = ("gpu block id", "cpu slot")


def outcome(fn, src, dst, src_len, dst_len):
    try:
        s, d = fn(src, dst, src_len, dst_len, *NAMES)
    except TransferError as e:
        return "error", str(e)
    assert s.dtype == d.dtype == np.int64
    return s.tolist(), d.tolist()


def through_the_door(src, dst, src_len, dst_len, src_name, dst_name):
    return check_id_arrays(src, dst, src_len=src_len, dst_len=dst_len, src_name=src_name, dst_name=dst_name)


ids = st.lists(st.integers(-3, 40), max_size=24)
kinds = st.sampled_from(["list", "tuple", "int64", "int32", "uint16", "numpy scalars", "tensor"])


def as_kind(values: list[int], kind: str):
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    if kind == "numpy scalars":
        return [np.int64(v) for v in values]
    if kind == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    if kind == "uint16":
        return np.array([v % 65536 for v in values], dtype=np.uint16)
    return np.array(values, dtype=kind)


@settings(max_examples=6 * EXAMPLES, deadline=None)
@given(ids, ids, kinds, kinds, st.integers(0, 45), st.integers(0, 45), st.booleans())
def test_the_native_check_matches_the_numpy_reference(src, dst, ks, kd, src_len, dst_len, distinct):
    if distinct:  # most batches are valid: dst distinct, same length, in range
        dst = list(dict.fromkeys(dst))
        src = (src + dst)[: len(dst)]
    a, b = as_kind(src, ks), as_kind(dst, kd)
    ref = outcome(reference, np.asarray(a), np.asarray(b), src_len, dst_len)
    assert outcome(through_the_door, a, b, src_len, dst_len) == ref


@pytest.mark.parametrize("odd", [[True, False], np.array([0.0, 1.0]), np.zeros((1, 2), np.int64), ["a", "b"]])
def test_what_is_not_a_list_of_integers_is_refused_in_the_references_words(odd):
    with pytest.raises(TransferError) as want:
        reference(odd, [0, 1], 4, 4, *NAMES)
    with pytest.raises(TransferError) as got:
        core.check_copy_ids(odd, [0, 1], 4, 4, *NAMES)
    assert str(got.value) == str(want.value) and "must be integers" in str(got.value)


def test_errors_carry_the_numbers_and_the_returned_arrays_are_the_callers_to_keep():
    a = np.array([3, 1, 2], dtype=np.int64)
    s, d = core.check_copy_ids(a, [0, 1, 2], 4, 3, *NAMES)
    assert s.tolist() == [3, 1, 2] and d.tolist() == [0, 1, 2]
    s[0] = 9  # the caller's own copy: writing it changes neither the input nor a later check
    assert a[0] == 3 and core.check_copy_ids(a, [0, 1, 2], 4, 3, *NAMES)[0][0] == 3
    with pytest.raises(TransferError, match=r"length mismatch: 3 gpu block ids vs 2 cpu slots"):
        core.check_copy_ids(a, [0, 1], 4, 3, *NAMES)
    with pytest.raises(TransferError, match=r"gpu block id 3 out of range \[0, 3\)"):
        core.check_copy_ids(a, [0, 1, 2], 3, 3, *NAMES)
    with pytest.raises(TransferError, match=r"cpu slot -1 out of range \[0, 3\)"):
        core.check_copy_ids(a, [0, -1, 2], 4, 3, *NAMES)
    with pytest.raises(TransferError, match=r"duplicate cpu slot 1 in one batch"):
        core.check_copy_ids(a, [1, 2, 1], 4, 3, *NAMES)
    big = np.array([2**63 + 5], dtype=np.uint64)  # wraps negative, as numpy's astype(int64) does: refused
    assert outcome(through_the_door, big, [0], 4, 4) == outcome(reference, big, [0], 4, 4)
