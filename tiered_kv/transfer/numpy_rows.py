"""NumpyRowEngine: host copies as numpy row copies on threads the engine owns, never a torch op.

A torch CPU op run from a thread other than the engine's own (index_select, a large copy_) starts
torch's intra-op pool for that thread, whose threads then compete with the model's forward pass: in a
vLLM worker that cost 4-5 ms per step. numpy copies run on the calling thread only and release the GIL.
Every batch runs on the direction's worker thread (never inline: the caller is the engine's thread),
so a direction's batches finish in submission order.
"""

from __future__ import annotations

import asyncio

import numpy as np

from tiered_kv.transfer.base import Compute, CopyHandle, Direction
from tiered_kv.transfer.host import HostCopyEngine


class NumpyRowEngine(HostCopyEngine):
    """HostCopyEngine's threads and ordering, with numpy slice / fancy-index copies only."""

    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        # ``compute`` orders nothing here (as in HostCopyEngine): the "GPU" tensors are CPU memory.
        if direction is Direction.STORE:
            job = (copy_rows, self._gpu_np, self._cpu_np, src, dst)
        else:
            job = (copy_rows, self._cpu_np, self._gpu_np, src, dst)
        self._queued[direction] += 1
        self._executors[direction].submit(self._threaded, job, handle, loop)


def copy_rows(src: list[np.ndarray], dst: list[np.ndarray], src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """``dst[r][dst_ids[i]] = src[r][src_ids[i]]`` for every region r: one slice copy per run consecutive
    on both sides, else one gather + scatter per region."""
    if len(src_ids) == 0:
        return
    both = np.concatenate(([0], np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)) + 1,
                           [len(src_ids)]))  # fmt: skip
    if len(both) - 1 > max(8, len(src_ids) // 4):  # many short runs: fancy indexing is cheaper
        for s, d in zip(src, dst, strict=True):
            d[dst_ids] = s[src_ids]
        return
    for a, b in zip(both[:-1].tolist(), both[1:].tolist(), strict=True):
        s0, d0, n = int(src_ids[a]), int(dst_ids[a]), b - a
        for s, d in zip(src, dst, strict=True):
            d[d0 : d0 + n] = s[s0 : s0 + n]

