"""The engines' id check (transfer/engines/base.py check_id_arrays) takes one native pass
(native/id_checks.hpp over copy_plan.hpp's checks) for integer arrays and lists of ints; its numpy body is
the reference: the same arrays out, or a TransferError with the same message, for every input."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.core import core
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.base import _check_id_arrays_numpy, check_id_arrays

EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "60"))
NAMES = ("gpu block id", "cpu slot")


def outcome(fn, src, dst, src_len, dst_len):
    try:
        s, d = fn(src, dst, src_len, dst_len, *NAMES)
    except TransferError as e:
        return "error", str(e)
    assert s.dtype == d.dtype == np.int64
    return s.tolist(), d.tolist()


ids = st.lists(st.integers(-3, 40), max_size=24)
kinds = st.sampled_from(["list", "int64", "int32", "uint16", "tuple"])


def as_kind(values: list[int], kind: str):
    if kind == "list":
        return values
    if kind == "tuple":
        return tuple(values)
    if kind == "uint16":
        return np.array([v % 65536 for v in values], dtype=np.uint16)
    return np.array(values, dtype=kind)


@settings(max_examples=6 * EXAMPLES, deadline=None)
@given(ids, ids, kinds, kinds, st.integers(0, 45), st.integers(0, 45), st.booleans())
def test_native_pass_matches_the_numpy_reference(src, dst, ks, kd, src_len, dst_len, distinct):
    if distinct:  # most batches are valid: dst distinct, same length, in range
        dst = list(dict.fromkeys(dst))
        src = (src + dst)[: len(dst)]
    a, b = as_kind(src, ks), as_kind(dst, kd)
    ref = outcome(_check_id_arrays_numpy, a, b, src_len, dst_len)
    assert outcome(native, a, b, src_len, dst_len) == ref
    assert outcome(through_the_door, a, b, src_len, dst_len) == ref


def native(src, dst, src_len, dst_len, src_name, dst_name):
    got = core.check_copy_ids(src, dst, src_len, dst_len, src_name, dst_name)
    if got is None:
        pytest.fail(f"integer ids ({type(src).__name__}, {type(dst).__name__}) fell back to numpy")
    return got


def through_the_door(src, dst, src_len, dst_len, src_name, dst_name):
    return check_id_arrays(src, dst, src_len=src_len, dst_len=dst_len, src_name=src_name, dst_name=dst_name)


def test_native_errors_carry_the_numbers_and_int64_arrays_are_not_copied():
    a = np.array([3, 1, 2], dtype=np.int64)
    s, d = core.check_copy_ids(a, [0, 1, 2], 4, 3, *NAMES)
    assert s is a and d.tolist() == [0, 1, 2]
    with pytest.raises(TransferError, match=r"length mismatch: 3 gpu block ids vs 2 cpu slots"):
        core.check_copy_ids(a, [0, 1], 4, 3, *NAMES)
    with pytest.raises(TransferError, match=r"gpu block id 3 out of range \[0, 3\)"):
        core.check_copy_ids(a, [0, 1, 2], 3, 3, *NAMES)
    with pytest.raises(TransferError, match=r"cpu slot -1 out of range \[0, 3\)"):
        core.check_copy_ids(a, [0, -1, 2], 4, 3, *NAMES)
    with pytest.raises(TransferError, match=r"duplicate cpu slot 1 in one batch"):
        core.check_copy_ids(a, [1, 2, 1], 4, 3, *NAMES)


def test_what_the_native_pass_leaves_to_numpy_is_still_checked():
    # Tensors, bools, floats, 2-D arrays and numpy scalars in a list: None natively, numpy decides.
    for odd in (torch.tensor([0, 1]), [True, False], np.array([0.0, 1.0]), np.zeros((1, 2), np.int64),
                [np.int64(0), np.int64(1)]):
        assert core.check_copy_ids(odd, [0, 1], 4, 4, *NAMES) is None
    s, _ = check_id_arrays(torch.tensor([0, 1]), [0, 1], src_len=4, dst_len=4)
    assert s.tolist() == [0, 1]
    with pytest.raises(TransferError, match="must be integers"):
        check_id_arrays(np.array([0.0, 1.0]), [0, 1], src_len=4, dst_len=4)
