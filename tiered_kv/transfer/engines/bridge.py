"""The CUDA event -> asyncio bridge.

One waiter thread per direction blocks in ``event.synchronize()`` (which
releases the GIL) for each batch in FIFO order, then resolves the batch's
future on the loop through ``loop.call_soon_threadsafe``. The loop itself never
blocks on the GPU. Any object with a ``synchronize()`` method works as the
event, which lets the bridge be tested without a GPU. ``on_start`` runs first on
the waiter thread: the CUDA engine sets its device there, since a CUDA call on a
thread whose current device is GPU 0 creates a context on GPU 0.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ...errors import TransferError

log = logging.getLogger(__name__)

Resolve = Callable[[asyncio.Future, "BaseException | None"], None]


class Synchronizable(Protocol):
    def synchronize(self) -> None: ...


class EventBridge:
    """A FIFO of (event, future) pairs drained by one daemon waiter thread."""

    def __init__(self, name: str, *, on_start: Callable[[], Any] | None = None) -> None:
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._stopped = False
        self._on_start = on_start
        # Daemon: a wedged GPU must not also wedge interpreter exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(
        self,
        event: Synchronizable,
        future: asyncio.Future,
        loop: asyncio.AbstractEventLoop,
        resolve: Resolve,
        *,
        error: BaseException | None = None,
        keepalive: Any = None,
    ) -> None:
        """Resolve ``future`` via ``resolve(future, err)`` once ``event`` has completed.

        ``error`` (e.g. a failure while enqueueing) is delivered only after the
        event, so the caller learns of it when no copy of the batch is still
        running. ``keepalive`` (index tensors, staging views) lives until then.
        """
        if self._stopped:
            raise TransferError(f"{self._thread.name}: bridge already stopped")
        self._queue.put((event, future, loop, resolve, error, keepalive))

    def stop(self) -> None:
        """Let the thread exit once it has drained what is queued."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:  # the waits below still wait (on any device): log, never drop a batch
                log.exception("%s: setting up the waiter thread failed", self._thread.name)
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, future, loop, resolve, error, keepalive = item
            item = None
            try:
                event.synchronize()
            except Exception as exc:
                err = TransferError(f"{self._thread.name}: waiting for the copy failed: {exc!r}")
                err.__cause__ = exc
                error = error or err
            keepalive = None  # noqa: F841 - the copy is done: its buffers may go now
            try:
                loop.call_soon_threadsafe(resolve, future, error)
            except RuntimeError:
                log.error("%s: event loop closed before a batch could be reported (error=%r)",
                          self._thread.name, error)  # fmt: skip
