"""Start and close for a resource that owns tasks: all or nothing, one close task, no cancel in halves.

``start()`` runs the owner's ``open_resources`` as a task of its own: a failure or a
cancellation of the caller releases everything taken so far (``release_resources``) and a
later ``start()`` may retry. ``aclose()`` runs as one task too: a cancelled caller leaves it
running and a second caller waits for the same task, never a polling loop. The tasks the
resource owns (a TaskSet) are never cancelled; ``aclose`` waits for them before releasing anything.

The cache holds one ``Lifecycle`` and hands it what to open, release and forget; nothing here
knows what a cache is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .errors import CacheClosedError
from .owned_tasks import TaskSet, finish_uncancelled


class Lifecycle:
    """States: new -> starting -> open -> closing -> closed (a failed start goes back to new).

    ``name`` names the owner in errors. ``open_resources``/``release_resources`` take and give
    back what the owner holds; ``reset_after_failed_start`` forgets what a failed start built.
    """

    def __init__(
        self,
        name: str,
        tasks: TaskSet,
        *,
        open_resources: Callable[[], Awaitable[None]],
        release_resources: Callable[[], Awaitable[None]],
        reset_after_failed_start: Callable[[], None],
    ) -> None:
        self.name = name
        self.state = "new"
        self._tasks = tasks
        self._open_resources = open_resources
        self._release_resources = release_resources
        self._reset_after_failed_start = reset_after_failed_start
        self._starting: asyncio.Future[None] | None = None
        self._closing: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Take every resource, or none: a failure or a cancellation releases what was taken."""
        if self.state == "open":
            return
        if self.state in ("closing", "closed"):
            raise CacheClosedError(f"start() on a {self.name} that is {self.state}; build a new one")
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._open_all())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Opening goes on in an executor; wait for it, then undo it: all or nothing.
            await finish_uncancelled(starting)
            if self.state == "open":
                await finish_uncancelled(asyncio.ensure_future(self._release_resources()))
                self._reset_after_failed_start()
                self.state = "new"
            raise
        finally:
            if self._starting is starting and starting.done():
                self._starting = None
        if self.state != "open":
            raise CacheClosedError(f"{self.name} is {self.state} after start()")

    async def _open_all(self) -> None:
        self.state = "starting"
        try:
            await self._open_resources()
        except BaseException:
            await finish_uncancelled(asyncio.ensure_future(self._release_resources()))
            self._reset_after_failed_start()
            self.state = "new"
            raise
        self.state = "open"

    async def aclose(self) -> None:
        """Drain every in-flight move, then release threads, files and pinned memory. Idempotent."""
        if self._closing is None:
            if self._starting is not None:
                await finish_uncancelled(self._starting)
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self.state = "closing"
        await self._tasks.drain()
        await self._release_resources()
        self.state = "closed"

    def check_open(self) -> None:
        if self.state != "open":
            raise CacheClosedError(f"{self.name} is {self.state}; use `async with {self.name}(...)`")
