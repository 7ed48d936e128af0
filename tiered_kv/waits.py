"""Waiting for a future to end even when the waiter is cancelled.

Cancelling an await does not stop a copy or a pwritev already under way: whoever owns the
buffers it touches must not move on before it has ended. The cache's lifecycle and moves and
the disk tier's calls all wait this way, so it sits below all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

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
