"""NumpyRowEngine: HostCopyEngine's native row copies, always on threads the engine owns.

A torch CPU op run from a thread other than the engine's own (index_select, a large copy_) starts
torch's intra-op pool for that thread, whose threads then compete with the model's forward pass: in a
vLLM worker that cost 4-5 ms per step. The native copies (native/rows.hpp) run on the calling thread
only and release the GIL. Every batch runs on the direction's worker thread (never inline: the caller
is the engine's thread), so a direction's batches finish in submission order.
"""

from __future__ import annotations

import asyncio

import numpy as np

from .base import Compute, CopyHandle, Direction
from .host import HostCopyEngine


class NumpyRowEngine(HostCopyEngine):
    """HostCopyEngine's copies, threads and ordering, never inline."""

    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        # ``compute`` orders nothing here (as in HostCopyEngine): the "GPU" tensors are CPU memory.
        job = (self._rows.copy, 0 if direction is Direction.STORE else 1, src, dst)
        self._queued[direction] += 1
        self._executors[direction].submit(self._threaded, job, handle, loop)

    def copy_inline(self, direction: Direction, src: np.ndarray, dst: np.ndarray) -> bool:
        return False  # never on the caller's thread (the engine's own, in a vLLM worker)

