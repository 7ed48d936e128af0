"""Validation of the engine's GPU block ids, before anything is reserved or copied."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from .errors import BlockIdError

_INT_TYPES = frozenset((int, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8))


def _fast_ids(ids: object) -> np.ndarray | None:
    """The ids as int64 when they are plainly integers (checked at C speed), else None (slow path)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False) if ids.ndim == 1 and ids.dtype.kind in "iu" else None
    if isinstance(ids, (list, tuple)) and set(map(type, ids)) <= _INT_TYPES:
        try:
            return np.fromiter(ids, dtype=np.int64, count=len(ids)) if ids else np.zeros(0, dtype=np.int64)
        except OverflowError:  # an int beyond 64 bits: the slow path names it
            return None
    return None


def check_block_ids(gpu_block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
    """Distinct ints in ``[0, num_blocks)`` as an int64 array; BlockIdError names the first bad one.

    ``True`` is not block 1 and ``"3"`` is not block 3: only integers (Python,
    numpy or a 1-D integer tensor) are block ids.
    """
    fast = _fast_ids(gpu_block_ids)
    if fast is not None:
        bad = (fast < 0) | (fast >= num_blocks)
        if not bad.any() and (len(fast) < 2 or len(np.unique(fast)) == len(fast)):
            return fast
    if isinstance(gpu_block_ids, torch.Tensor):
        if gpu_block_ids.dim() != 1 or gpu_block_ids.dtype.is_floating_point or gpu_block_ids.dtype == torch.bool:
            raise BlockIdError(f"gpu_block_ids tensor must be 1-D integers, got {gpu_block_ids.dtype} "
                               f"of shape {list(gpu_block_ids.shape)}")  # fmt: skip
        ids = gpu_block_ids.tolist()
    elif isinstance(gpu_block_ids, (str, bytes, bytearray)) or not isinstance(gpu_block_ids, (Sequence, np.ndarray)):
        raise BlockIdError(f"gpu_block_ids must be a sequence of ints, got {type(gpu_block_ids).__name__}")
    else:
        ids = []
        for i, gid in enumerate(gpu_block_ids):
            if isinstance(gid, (bool, np.bool_)):
                raise BlockIdError(f"gpu_block_ids[{i}] is {gid!r}, a bool, not a block id")
            try:
                ids.append(operator.index(gid))
            except TypeError:
                raise BlockIdError(
                    f"gpu_block_ids[{i}] is a {type(gid).__name__} ({gid!r}), not an int"
                ) from None
    for i, gid in enumerate(ids):
        if not 0 <= gid < num_blocks:
            raise BlockIdError(f"gpu_block_ids[{i}] = {gid} is out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise BlockIdError("gpu_block_ids contains duplicates: one GPU block cannot hold two keys")
    return np.asarray(ids, dtype=np.int64)
