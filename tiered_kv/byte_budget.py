"""A FIFO budget of bytes in flight: callers beyond it wait their turn."""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """``acquire(n)`` waits until ``n`` more bytes fit under ``limit``.

    A request larger than the whole limit is admitted when nothing else is in
    flight, so one oversized batch cannot deadlock. Waiters are served in
    order, so a large request is not starved by a stream of small ones.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"transfer.max_inflight_bytes must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    def admits_now(self, n: int) -> bool:
        """Whether ``acquire(n)`` would return at once (no waiter ahead): a copy that starts and ends
        within one call may then run without taking the budget at all."""
        return not self._waiters and self._fits(n)

    def take_now(self, n: int) -> bool:
        """Acquire ``n`` at once if ``acquire(n)`` would not wait; False, having taken nothing, otherwise."""
        if not self.admits_now(n):
            return False
        self.used += max(n, 0)
        return True

    async def acquire(self, n: int) -> None:
        if n <= 0:
            return
        if not self._waiters and self._fits(n):
            self.used += n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled: give it back
            else:
                self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        if n <= 0:
            return
        self.used -= n
        if self.used < 0:
            raise RuntimeError(f"byte budget released more than acquired (used={self.used})")
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(n):
                return
            self._waiters.popleft()
            self.used += n
            fut.set_result(None)
