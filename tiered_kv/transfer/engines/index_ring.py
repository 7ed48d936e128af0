"""A preallocated pinned ring for the GPU index tensors of copy batches (issue 27, defect D).

Pinning a fresh host tensor per batch (``tensor.pin_memory()``) takes the driver's lock on every call;
vLLM removed exactly that after it stalled their step loop. Here one pinned int64 buffer is allocated up
front and each batch's ids are written into the next free stretch of it. A stretch is in use until the
event of the batch that uploads it has completed (``query()``, never a wait: the loop thread must not
block on the GPU), so a batch never overwrites ids another batch's upload still reads. When the ring
is full, or a batch's ids are longer than the ring, ``take`` returns None and the caller pins a one-off
tensor, as before. Device-agnostic: CPU tests drive it with any object that has ``query()``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

DEFAULT_IDS = 1 << 17  # 1 MiB of int64 ids: tens of batches of thousands of blocks


class IndexRing:
    """``take(ids)`` -> a host view holding ``ids`` (or None); ``seal(event)`` ties the views taken since
    the last seal to the event of the batch that reads them."""

    def __init__(self, capacity: int = DEFAULT_IDS, *, pin: bool = True) -> None:
        self.capacity = int(capacity)
        self.buf = torch.empty(self.capacity, dtype=torch.int64, pin_memory=pin)
        self._np = self.buf.numpy()
        self._head = 0  # where the next stretch starts
        self._sealed: deque[tuple[int, int, Any]] = deque()  # (start, end, event), oldest first
        self._open: list[tuple[int, int]] = []  # taken since the last seal
        self.fallbacks = 0  # batches that found no room (a one-off pinned tensor instead)

    def take(self, ids: np.ndarray) -> torch.Tensor | None:
        n = len(ids)
        self._reap()
        start = self._fit(n) if 0 < n <= self.capacity else None
        if start is None:
            self.fallbacks += 1
            return None
        self._np[start : start + n] = ids
        self._open.append((start, start + n))
        self._head = start + n
        return self.buf[start : start + n]

    def seal(self, event: Any) -> None:
        """The views taken since the last seal are read by work that ``event`` completes."""
        if self._open:
            self._sealed.append((self._open[0][0], self._open[-1][1], event))
            self._open = []

    @property
    def in_use(self) -> int:
        return len(self._sealed) + len(self._open)

    def _reap(self) -> None:
        while self._sealed and self._sealed[0][2].query():
            self._sealed.popleft()
        if not self._sealed and not self._open:
            self._head = 0

    def _oldest(self) -> int | None:
        if self._sealed:
            return self._sealed[0][0]
        return self._open[0][0] if self._open else None

    def _fit(self, n: int) -> int | None:
        oldest = self._oldest()
        if oldest is None:
            return 0
        if self._head > oldest:  # in use: [oldest, head)
            if self._head + n <= self.capacity:
                return self._head
            return 0 if n <= oldest else None  # wrap around to the start
        return self._head if self._head + n <= oldest else None  # wrapped: free is [head, oldest)
