"""A DiskStore batch's arguments, checked on the loop before any I/O (vectorized): slot arrays in
range, a slab the record I/O can read or write, keys of the namespace's length.

A batch that fails here raises LayoutError or KeyFormatError and nothing of it is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import KeyFormatError, LayoutError


def slot_array(a: Any, name: str, limit: int) -> np.ndarray:
    """``a`` as a 1-D int64 array of slots in ``[0, limit)``."""
    arr = np.asarray(a)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise LayoutError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if len(arr) and (arr.min() < 0 or arr.max() >= limit):
        bad = int(arr[(arr < 0) | (arr >= limit)][0])
        raise LayoutError(f"{name}: slot {bad} out of range [0, {limit})")
    return arr


def check_batch(
    disk_slots: Any, cpu_slots: Any, slab: Any, num_slots: int, bytes_per_block: int, *, writable: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(disk slots, CPU slab rows) of one batch, as int64 arrays of equal length."""
    bpb = bytes_per_block
    if not slab_ok(slab, bpb):
        raise LayoutError(
            f"the slab must be a C-contiguous uint8 [rows, {bpb}] array, or a uint8 [rows, "
            f"ranks, shard] block view with ranks x shard = {bpb} (bytes_per_block) and "
            f"dense shard rows; got {getattr(slab, 'dtype', type(slab).__name__)} "
            f"{getattr(slab, 'shape', '')} strides {getattr(slab, 'strides', '')}"
        )
    if writable and not slab.flags.writeable:
        raise LayoutError("the slab is read-only; read_many needs to write into it")
    d = slot_array(disk_slots, "disk_slots", num_slots)
    c = slot_array(cpu_slots, "cpu_slots", slab.shape[0])
    if len(d) != len(c):
        raise LayoutError(f"{len(d)} disk slots but {len(c)} cpu slots in one batch")
    return d, c


def check_keys(keys: Any, n: int, key_bytes: int) -> np.ndarray:
    if not (isinstance(keys, np.ndarray) and keys.dtype == np.uint8 and keys.shape == (n, key_bytes)):
        raise KeyFormatError(
            f"disk tier keys must be a uint8 [{n}, {key_bytes}] array (key_bytes "
            f"{key_bytes}); got {getattr(keys, 'dtype', type(keys).__name__)} "
            f"{getattr(keys, 'shape', '')}"
        )
    return keys


def slab_ok(slab: Any, bpb: int) -> bool:
    """A 2-D C-contiguous slab of whole blocks, or a 3-D block view whose every rank piece is a dense row
    (tiers/segment_geometry.py: the shared segment's sub-slabs); records.SlabParts reads either."""
    if not (isinstance(slab, np.ndarray) and slab.dtype == np.uint8):
        return False
    if slab.ndim == 2:
        return slab.shape[1] == bpb and slab.flags.c_contiguous
    if slab.ndim != 3 or slab.shape[1] * slab.shape[2] != bpb:
        return False
    return slab.strides[2] == 1 and min(slab.strides[:2]) >= slab.shape[2]
