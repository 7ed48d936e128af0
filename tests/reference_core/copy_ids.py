"""Reference model of the engines' id check (native/copy_plan.hpp check_ids, bound as core.check_copy_ids and
called by transfer/engines/base.py check_id_arrays): the numpy checks it replaced, messages word for word."""

from __future__ import annotations

import numpy as np

from tiered_kv.errors import TransferError


def id_array(ids, name: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        raise TransferError(f"{name}s must be integers, got {arr.dtype} of shape {list(arr.shape)}")
    return arr.astype(np.int64, copy=False)


def check_copy_ids(src_ids, dst_ids, src_len: int, dst_len: int, src_name: str,
                   dst_name: str) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    src, dst = id_array(src_ids, src_name), id_array(dst_ids, dst_name)
    if len(src) != len(dst):
        raise TransferError(f"length mismatch: {len(src)} {src_name}s vs {len(dst)} {dst_name}s")
    for ids, length, name in ((src, src_len, src_name), (dst, dst_len, dst_name)):
        bad = (ids < 0) | (ids >= length)
        if bad.any():
            raise TransferError(f"{name} {int(ids[np.argmax(bad)])} out of range [0, {length})")
    if len(dst) > 1:
        ordered = np.sort(dst)
        dup = ordered[1:] == ordered[:-1]
        if dup.any():
            raise TransferError(f"duplicate {dst_name} {int(ordered[1:][np.argmax(dup)])} in one batch")
    return src, dst
