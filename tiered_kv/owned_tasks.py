"""Tasks a resource owns, and waiting for a future to end even when the waiter is cancelled.

Cancelling an await does not stop a copy or a pwritev already under way: whoever owns the
buffers it touches must not move on before it has ended. So the tasks and futures of a cache's
moves are never cancelled (``TaskSet``: its close waits for every one), and a cancelled caller
still waits for its move to end (``wait_to_end``), as the disk tier's calls do. Generic asyncio,
below everything that moves bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("tiered_kv.lifecycle")
T = TypeVar("T")


async def finish_uncancelled(fut: asyncio.Future[Any]) -> None:
    """Wait until ``fut`` is done, absorbing our own cancellation meanwhile (the caller re-raises)."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except BaseException:
            break


async def wait_to_end(fut: asyncio.Future[T], on_cancel: Callable[[], None] | None = None) -> T:
    """Await ``fut``; if the caller is cancelled, run ``on_cancel``, wait for ``fut`` to end, then re-raise."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        await finish_uncancelled(fut)
        if fut.done() and not fut.cancelled():
            fut.exception()  # consumed: the caller asked to cancel and gets CancelledError
        raise


class TaskSet:
    """The tasks and futures a resource owns: never cancelled, all awaited by ``drain`` (at close)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Future[Any]]:
        return iter(self._tasks)

    def spawn(self, coro: Awaitable[T], *, background: bool = False) -> asyncio.Task[T]:
        """Run a move the resource owns. A background task has no caller to raise to, so its
        failure is logged at WARNING; otherwise the caller awaits it and gets its error."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._background_done if background else self._task_done)
        return task

    def own(self, fut: asyncio.Future[T]) -> asyncio.Future[T]:
        """A future that is not a task (a copy on an engine's thread): ``drain`` waits for it too."""
        self._tasks.add(fut)
        fut.add_done_callback(self._task_done)
        return fut

    async def drain(self) -> None:
        """Wait until every owned task has ended, those they start meanwhile included."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # raised to the awaiting caller; marked retrieved here

    def _background_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tiered_kv background task failed: %r", task.exception())
