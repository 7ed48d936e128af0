"""Start and close for a resource that owns tasks: all or nothing, one close task, no cancel in halves.

``start()`` runs the subclass's ``_open_resources`` as a task of its own: a
failure or a cancellation of the caller releases everything taken so far
(``_release_resources``) and a later ``start()`` may retry. ``aclose()`` runs as
one task too: a cancelled caller leaves it running and a second caller waits for
the same task, never a polling loop. The tasks a resource spawns are never
cancelled; ``aclose`` waits for them before releasing anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from .errors import CacheClosedError
from .waits import finish_uncancelled

log = logging.getLogger(__name__)
T = TypeVar("T")


class Lifecycle:
    """States: new -> starting -> open -> closing -> closed (a failed start goes back to new)."""

    def __init__(self) -> None:
        self._state = "new"
        self._starting: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _open_resources(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def _release_resources(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _reset_after_failed_start(self) -> None:
        """Forget state built by a failed start (subclasses rebuild their bookkeeping)."""

    async def start(self) -> Any:
        """Take every resource, or none: a failure or a cancellation releases what was taken."""
        if self._state == "open":
            return self
        if self._state in ("closing", "closed"):
            raise CacheClosedError(f"start() on a {type(self).__name__} that is {self._state}; build a new one")
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._open_all())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Opening goes on in an executor; wait for it, then undo it: all or nothing.
            await finish_uncancelled(starting)
            if self._state == "open":
                await finish_uncancelled(asyncio.ensure_future(self._release_resources()))
                self._reset_after_failed_start()
                self._state = "new"
            raise
        finally:
            if self._starting is starting and starting.done():
                self._starting = None
        if self._state != "open":
            raise CacheClosedError(f"{type(self).__name__} is {self._state} after start()")
        return self

    async def _open_all(self) -> None:
        self._state = "starting"
        try:
            await self._open_resources()
        except BaseException:
            await finish_uncancelled(asyncio.ensure_future(self._release_resources()))
            self._reset_after_failed_start()
            self._state = "new"
            raise
        self._state = "open"

    async def __aenter__(self) -> Any:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drain every in-flight move, then release threads, files and pinned memory. Idempotent."""
        if self._closing is None:
            if self._starting is not None:
                await finish_uncancelled(self._starting)
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._state = "closing"
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._release_resources()
        self._state = "closed"

    def _check_open(self) -> None:
        if self._state != "open":
            raise CacheClosedError(f"{type(self).__name__} is {self._state}; use `async with {type(self).__name__}(...)`")

    def spawn(self, coro: Awaitable[T], *, background: bool = False) -> asyncio.Task[T]:
        """Run a move the resource owns: never cancelled, always awaited by aclose().

        A background task has no caller to raise to, so its failure is logged at WARNING.
        """
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._background_done if background else self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # raised to the awaiting caller; marked retrieved here

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tiered_kv background task failed: %r", task.exception())
