"""What a caller's move carries through the execute phase, and how the caller waits for it.

``MoveControl`` is one call's state that its runner reads between copies (the caller's cancel,
whether it holds anything yet, a load's hook and pins, the compute event every GPU copy waits
on). ``run_move`` runs the move as a task the cache owns and waits for it under the cache's
contract: a cancelled caller returns only once every copy into or out of its GPU blocks has
landed. ``ThreadedCopyFuture`` is the one future of a call whose copy runs on the engine's
thread; ``Outcome`` makes it only when a copy is handed off. ``Progress`` wakes moves that wait for room or for another call's keys.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ...owned_tasks import TaskSet, wait_to_end

T = TypeVar("T")


class MoveControl:
    """One store's or load's control state, set by its caller and read by its runner between copies."""

    __slots__ = ("cancelled", "idle", "before_copy", "hold", "base", "compute")

    def __init__(self, compute: Any = None) -> None:
        self.cancelled = False
        self.idle = False  # True while the move holds nothing and issued no copy: safe to cancel outright
        self.before_copy: Callable[[], Awaitable[Any]] | None = None  # a load's hook, run once
        self.hold: Any = None  # an exclusive load's pins on its run (manager.loading.RunHold)
        self.base = 0  # position in the load's keys of the chunk being planned
        self.compute = compute  # the caller's compute event: every GPU copy of the move waits on it


class ThreadedCopyFuture(asyncio.Future):
    """The one future of a call whose copy runs on the engine's thread, resolved (on the loop) once the
    copy has landed and the plan is committed. A caller's cancel cannot cancel it: it marks the call
    given up (a store then discards what it copied: the caller may reuse its GPU blocks at once), and
    the caller's task gets CancelledError only once the copy has landed, as the contract says."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.gave_up = False

    def cancel(self, msg: Any = None) -> bool:
        self.gave_up = True
        return False


class Outcome:
    """Where a started copy's caller learns its end: on the loop a ThreadedCopyFuture, made only once
    the copy is handed off (most land inline, within the call); off the loop a
    ``concurrent.futures.Future`` made up front. Calling it returns the future."""

    __slots__ = ("_future", "_loop", "on_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop
        self.on_loop = loop is not None
        self._future: Any = None if loop is not None else concurrent.futures.Future()

    def __call__(self) -> Any:
        if self._future is None:
            self._future = ThreadedCopyFuture(self._loop)
        return self._future


class Progress:
    """Resolved (and replaced) whenever a plan completes: room freed, an in-flight key landed."""

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    async def wait(self, control: MoveControl) -> None:
        """Wait until some plan completes; the move holds nothing meanwhile, so it may be cancelled."""
        if self._fut is None or self._fut.done():
            self._fut = asyncio.get_running_loop().create_future()
        control.idle = True
        try:
            await asyncio.shield(self._fut)
        finally:
            control.idle = False

    def notify(self) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(None)


async def run_move(tasks: TaskSet, control: MoveControl, move: Coroutine[Any, Any, T]) -> T:
    """Run ``move`` (a runner's coroutine over ``control``) as a task the cache owns; the caller waits
    for it, cancelled or not.

    On cancellation the flag stops the move before its next copy, and the caller
    still waits (shielded) until the copies already issued into or out of its
    GPU blocks have landed: the engine reuses those blocks the moment we return.
    """
    task = tasks.spawn(move)

    def stop() -> None:
        control.cancelled = True
        if control.idle:  # waiting for room or another call: nothing reserved, nothing copying
            task.cancel()

    return await wait_to_end(task, stop)
