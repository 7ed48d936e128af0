"""One lock over a cache's state, shared by its event loop's thread and the threads that call it directly.

The loop (``locked_loop``) holds the lock whenever it runs callbacks and lets go of it only while it
waits for I/O (its selector's ``select``). A thread that calls the cache's synchronous methods takes the
same lock (``StateLock.held``): it then runs only while the loop is parked between callbacks, so every
"no await between a check and its mutation" invariant of the cache's asyncio code still holds.

The hand-off favours the callers: the loop re-takes the lock after a select only when no caller is
waiting for it, or when a caller let go of it while the loop waited (then the loop runs one iteration
before the next caller: callers that come back to back cannot starve it). So a caller waits at most for
the callbacks of one loop iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import threading
from collections.abc import Iterator

__all__ = ["StateLock", "borrowed_loop", "has_callbacks", "locked_loop"]


class StateLock:
    """A reentrant lock whose waiting callers go before the loop (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._count = 0
        self._wanted = 0  # callers (not the loop) waiting for the lock
        self._loop_waiting = False
        self._loop_turn = False  # a caller let go while the loop waited: the loop goes next

    def acquire(self, *, polite: bool = False) -> None:
        """Take the lock (reentrant). ``polite`` (the loop): wait while any other caller wants it."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._count += 1
                return
            if polite:
                self._loop_waiting = True
            else:
                self._wanted += 1
            try:
                while self._owner is not None or (
                    (self._wanted and not self._loop_turn) if polite else self._loop_turn
                ):
                    self._cond.wait()
            finally:
                if polite:
                    self._loop_waiting = self._loop_turn = False
                else:
                    self._wanted -= 1
                    if not self._wanted:
                        self._cond.notify_all()
            self._owner, self._count = me, 1

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("StateLock released by a thread that does not hold it")
            self._count -= 1
            if not self._count:
                self._owner = None
                self._loop_turn = self._loop_waiting  # one loop iteration between two callers' turns
                self._cond.notify_all()

    def held_by_me(self) -> bool:
        return self._owner == threading.get_ident()

    def suspend(self) -> int:
        """Let go of the lock entirely (however deep this thread holds it); the depth, for ``resume``."""
        with self._cond:
            if self._owner != threading.get_ident():
                return 0
            depth, self._owner, self._count = self._count, None, 0
            self._loop_turn = self._loop_waiting
            self._cond.notify_all()
            return depth

    def resume(self, depth: int, *, polite: bool = False) -> None:
        """Take the lock back at the depth ``suspend`` returned (nothing when it returned 0)."""
        if not depth:
            return
        self.acquire(polite=polite)
        with self._cond:
            self._count = depth

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()


class _LockedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The loop's selector: the lock is let go while (and only while) the loop waits for I/O."""

    def __init__(self, lock: StateLock) -> None:
        super().__init__()
        self._state_lock = lock

    def select(self, timeout: float | None = None):  # type: ignore[override]
        depth = self._state_lock.suspend()
        try:
            return super().select(timeout)
        finally:
            self._state_lock.resume(depth, polite=True)


def locked_loop(lock: StateLock) -> asyncio.AbstractEventLoop:
    """asyncio's selector loop over ``lock`` (uvloop cannot let go of a lock around its polls). Its thread
    must take the lock before ``run_forever`` and release it after."""
    return asyncio.SelectorEventLoop(_LockedSelector(lock))


# The only private asyncio names in the package live below, each for a reason no public API covers.


@contextlib.contextmanager
def borrowed_loop(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Make ``loop`` this thread's running loop while the thread holds the state lock (the loop is parked):
    the cache's synchronous code creates futures and schedules callbacks with ``get_running_loop()``, and
    asyncio has no public way to run a loop's code on another thread than the one in ``run_forever``."""
    before = asyncio.events._get_running_loop()
    asyncio.events._set_running_loop(loop)
    try:
        yield
    finally:
        asyncio.events._set_running_loop(before)


def has_callbacks(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` has callbacks ready to run (its ``_ready`` queue; True when a loop has none such):
    a caller that scheduled nothing need not wake it (a wake-up is a write and a loop iteration)."""
    return bool(getattr(loop, "_ready", True))
