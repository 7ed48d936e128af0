"""Validation of the engine's GPU block ids, before anything is reserved or copied."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from .errors import BlockIdError


def check_block_ids(gpu_block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """Distinct ints in ``[0, num_blocks)`` as a plain list; BlockIdError names the first bad one.

    ``True`` is not block 1 and ``"3"`` is not block 3: only integers (Python,
    numpy or a 1-D integer tensor) are block ids.
    """
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
    return ids
