"""Whole blocks of a shared CPU slab (tiers.shared_slabs.SharedCpuSlabs) as the ranks see them, for tests:
a block is its stored ranks' pieces in rank order (``slab_np[slot]``)."""

from __future__ import annotations

import numpy as np


def read_blocks(slabs, slots) -> np.ndarray:
    """Blocks ``slots`` as one contiguous ``uint8[n, bytes_per_block]`` copy (rank 0's bytes first)."""
    return slabs.slab_np[slots].reshape(-1, slabs.bytes_per_block)


def write_blocks(slabs, slots, rows: np.ndarray) -> None:
    """Write whole blocks (``uint8[n, bytes_per_block]``, rank order) into ``slots``."""
    slabs.slab_np[slots] = np.asarray(rows, np.uint8).reshape(-1, *slabs.slab_np.shape[1:])
