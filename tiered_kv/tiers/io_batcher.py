"""Coalesce concurrent disk calls into executor jobs, and their completions into one loop wake-up each."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any


async def wait_to_end(fut: asyncio.Future) -> Any:
    """Await ``fut``; if the caller is cancelled, still wait for it to finish before re-raising."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait({fut})
            except asyncio.CancelledError:
                continue
        if not fut.cancelled():
            fut.exception()  # consumed: the caller asked to cancel and gets CancelledError
        raise


class IOBatcher:
    """Coalesces concurrent calls into executor jobs and completions into event-loop wake-ups.

    An executor round trip through asyncio costs ~30-50 us here, as much as a 256 KiB pwrite, so the hot
    path does not take one per block: each job (at most ``jobs`` at once, one per I/O thread) takes its
    share of the queue, runs ``run_batch`` on it in the worker thread, and posts the results; one
    ``call_soon_threadsafe`` resolves every result posted since the last. Jobs go to the store's own
    executor, as aiofiles would send them, minus its per-call future.
    """

    def __init__(self, run_batch: Any, jobs: int) -> None:
        self._run_batch, self.max_jobs = run_batch, jobs
        self._lock = threading.Lock()  # held for O(1) queue/count updates only
        self._q: deque[tuple[tuple, asyncio.Future]] = deque()
        self._running = self._busy = 0
        self._done: deque[tuple[asyncio.Future, Any]] = deque()
        self._wake_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call(self, executor: ThreadPoolExecutor, *args: Any) -> Any:
        self._loop = loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._q.append((args, fut))
            start = self._running < self.max_jobs
            self._running += start
        if start:
            executor.submit(self._job)
        return await wait_to_end(fut)

    def _job(self) -> None:  # worker thread
        while True:
            with self._lock:
                if not self._q:
                    self._running -= 1
                    return
                share = -(-len(self._q) // (self._running - self._busy))  # ceil over jobs not in a batch
                items = [self._q.popleft() for _ in range(min(share, len(self._q)))]
                self._busy += 1
            try:
                results = self._run_batch([a for a, _ in items])
            except Exception as e:  # the batch as a whole failed: every item gets the error
                results = [e] * len(items)
            finally:
                with self._lock:
                    self._busy -= 1
            self._done.extend(zip([f for _, f in items], results, strict=True))
            with self._lock:
                wake, self._wake_pending = not self._wake_pending, True
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self._drain)  # type: ignore[union-attr]
                except RuntimeError:  # the loop is gone (interpreter teardown): nobody awaits these
                    pass

    def _drain(self) -> None:  # event loop
        with self._lock:
            self._wake_pending = False  # before reading _done: a later post schedules another drain
        while self._done:
            fut, r = self._done.popleft()
            if not fut.done():
                fut.set_exception(r) if isinstance(r, BaseException) else fut.set_result(r)
