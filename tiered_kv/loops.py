"""The event loops tiered_kv itself creates: uvloop when it is importable, asyncio's own otherwise.

Only the loops this package starts come from here: ``tiered-kv replay``, ``tiered-kv bench`` and the
vLLM connector's loop threads, but for a ``LoopThread`` over a state lock (the connector's scheduler
half), which is always asyncio's selector loop: it lets go of the lock around its polls (state_lock.py). A frontend that embeds TieredKVCache runs it on its own loop, whatever
that is; nothing here installs a policy or touches a loop the caller made.

``TIERED_KV_UVLOOP`` chooses: unset or ``auto`` takes uvloop when importable; ``0``/``off``/``false``/``no``
keeps asyncio's loop; ``1``/``on``/``true``/``yes`` requires uvloop (a ConfigError when it is missing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import ConfigError, TransferError
from .state_lock import StateLock, locked_loop

__all__ = ["ENV_VAR", "LoopThread", "loop_factory", "new_loop", "run", "uvloop_chosen"]

log = logging.getLogger(__name__)

ENV_VAR = "TIERED_KV_UVLOOP"
_OFF, _ON, _AUTO = {"0", "off", "false", "no"}, {"1", "on", "true", "yes"}, {"", "auto"}


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def uvloop_chosen() -> bool:
    """Whether the loops tiered_kv creates use uvloop, from ``TIERED_KV_UVLOOP`` and what is installed."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _OFF:
        return False
    if value not in _ON | _AUTO:
        raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: expected auto, 1/on/true/yes or 0/off/false/no")
    if _uvloop() is not None:
        return True
    if value in _ON:
        raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} asks for uvloop, which is not importable "
                          f"(pip install uvloop; it does not exist on Windows)")  # fmt: skip
    return False


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """A no-argument callable that makes a new loop of the chosen kind (for asyncio.Runner and friends)."""
    return _uvloop().new_event_loop if uvloop_chosen() else asyncio.new_event_loop


def new_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the chosen kind, not set as anybody's current loop (for a loop thread)."""
    return loop_factory()()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(coro)`` on a new loop of the chosen kind."""
    try:
        chosen = uvloop_chosen()
    except ConfigError:
        coro.close()  # never started: close it so it does not warn about never being awaited
        raise
    return _uvloop().run(coro) if chosen else asyncio.run(coro)


CALL_TIMEOUT_S = 120.0  # a load or store that takes longer is a fault, reported as one


class LoopThread:
    """An event loop (``new_loop``) on a daemon thread; ``call`` waits for a coroutine, ``submit`` does not.

    For a caller on a synchronous thread (vLLM's engine thread) driving a cache that lives on the loop.
    ``lock`` (a ``state_lock.StateLock``): the loop is asyncio's selector loop, holding the lock but while
    it waits for I/O; a call made while holding the lock lets go of it until the call returns.
    """

    def __init__(self, name: str = "tiered-kv-loop", device: Any = None, lock: StateLock | None = None) -> None:
        self._lock = lock
        self._loop = new_loop() if lock is None else locked_loop(lock)
        self._device = device
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        # The loop thread is ours: its current device must be the KV tensors' (the copy
        # engine's CUDA calls run here), or each call would create a context on GPU 0.
        if self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.set_device(self._device)
        if self._lock is None:
            self._loop.run_forever()
            return
        self._lock.acquire(polite=True)
        try:
            self._loop.run_forever()
        finally:
            self._lock.release()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def wake(self) -> None:
        """Make the loop look at its callbacks again (a caller under the lock may have scheduled some)."""
        try:
            self._loop.call_soon_threadsafe(_nothing)
        except RuntimeError:  # closed
            pass

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Start ``coro`` on the loop; its outcome comes back on the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds before cancelling it.

        A call that times out is cancelled, and this still waits until the call has
        ended: a cancelled load or store returns only once its copies into or out of
        the caller's blocks have landed (the cache's contract), and the caller may reuse
        those blocks the moment we return. Then it raises TransferError.
        """
        outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()
        task: list[asyncio.Task] = []

        def start() -> None:
            task.append(self._loop.create_task(coro))
            task[0].add_done_callback(lambda t: _settle(outcome, t))

        self._loop.call_soon_threadsafe(start)
        depth = self._lock.suspend() if self._lock is not None else 0  # the loop needs it to run the call
        try:
            return self._wait(outcome, task, timeout)
        finally:
            if depth:
                self._lock.resume(depth)

    def _wait(self, outcome: concurrent.futures.Future, task: list[asyncio.Task], timeout: float) -> Any:
        try:
            return outcome.result(timeout)
        except concurrent.futures.TimeoutError:
            if outcome.done():  # the call itself raised TimeoutError
                raise
        self._loop.call_soon_threadsafe(lambda: task[0].cancel())  # after start: the loop runs callbacks in order
        while True:
            try:
                return outcome.result(timeout)  # it finished between the timeout and the cancel
            except concurrent.futures.CancelledError:
                raise TransferError(f"tiered_kv call timed out after {timeout} s; it was cancelled and its "
                                    "copies have landed") from None  # fmt: skip
            except concurrent.futures.TimeoutError:
                if outcome.done():
                    raise
                if not self._thread.is_alive():
                    raise TransferError("tiered_kv: the cache's loop thread stopped during a call") from None
                log.warning("tiered_kv: a call cancelled after %.0f s is still waiting for its copies", timeout)

    def stop(self) -> None:
        """Stop the loop and join its thread (the loop is closed once the thread has ended)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        depth = self._lock.suspend() if self._lock is not None else 0
        try:
            self._thread.join(timeout=30)
        finally:
            if depth:
                self._lock.resume(depth)
        if not self._thread.is_alive():
            self._loop.close()


def _nothing() -> None:
    pass


def _settle(outcome: concurrent.futures.Future, task: asyncio.Task) -> None:
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())
    else:
        outcome.set_result(task.result())
