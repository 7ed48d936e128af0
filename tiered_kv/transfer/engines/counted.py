"""Loop-free copies (base.CountedCopies) for the worker's ShardCopier: started on the caller's thread, finished
per direction in start order, completion read from a counter (issue 46 item 6).

A vLLM worker's copier used to run an event loop on a thread of its own: every job took a hop to that loop,
a future, a waiter thread and another hop back, ~0.5 ms of Python beside the model's own thread. Here the
caller starts the copy (one hand-off to the engine's worker, or one native submit) and reads what landed
from a counter; ``wait_copies`` sleeps in a lock or a ``select`` with the GIL released.

- ``Completions``: the per-direction counters and the condition a finisher signals.
- ``CountedRowEngine``: the host engine's native row copies on its worker thread per direction (never
  inline: the caller is the model's thread), each bumping the counter when its bytes have landed.
- ``CountedDirectEngine``: the direct road, whose native completion thread already keeps the counters
  and writes an eventfd: ``copies_done`` reads them, ``wait_copies`` sleeps in ``select`` on the fd.
The CUDA stream engine implements the protocol itself (cuda.py: its waiter thread bumps a ``Completions``).
"""

from __future__ import annotations

import select
import threading
import time

import numpy as np

from ...errors import TransferError
from .base import Compute, Direction
from .direct import DirectCopyEngine
from .numpy_rows import NumpyRowEngine

_SLICE_S = 0.05  # a waiter re-reads the counters at least this often (another thread may have drained the fd)


class Completions:
    """Started and finished batches per direction (finished in start order) and their failures."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._started = {d: 0 for d in Direction}
        self._done = {d: 0 for d in Direction}
        self._failed: dict[Direction, dict[int, str]] = {d: {} for d in Direction}

    def issue(self, direction: Direction) -> int:
        with self._cond:
            self._started[direction] += 1
            return self._started[direction]

    def finish(self, direction: Direction, seq: int, error: str | None) -> None:
        """Batch ``seq`` (and, by the order, every one before it) has finished; wake the waiters."""
        with self._cond:
            if error is not None:
                self._failed[direction][seq] = error
            self._done[direction] = max(self._done[direction], seq)
            self._cond.notify_all()

    def done(self, direction: Direction) -> tuple[int, dict[int, str]]:
        with self._cond:
            failed, self._failed[direction] = self._failed[direction], {}
            return self._done[direction], failed

    def wait(self, direction: Direction, seq: int, timeout_s: float | None) -> bool:
        with self._cond:  # Condition.wait blocks in a lock acquire: the GIL is released meanwhile
            return self._cond.wait_for(lambda: self._done[direction] >= seq, timeout_s)

    def wait_all(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done == self._started, timeout_s)


class CountedByCompletions:
    """``CountedCopies`` read from ``self._counts`` (a Completions) for an engine whose copies also end through
    its asyncio API: ``close_copies`` releases it only when nothing was submitted through that API."""

    _counts: Completions

    def copies_done(self, direction: Direction) -> tuple[int, dict[int, str]]:
        return self._counts.done(direction)

    def wait_copies(self, direction: Direction, seq: int, timeout_s: float | None = None) -> bool:
        return self._counts.wait(direction, seq, timeout_s)

    def close_copies(self) -> None:
        self._closed = True
        self._counts.wait_all()
        if not self._pending:  # nothing was submitted through the asyncio API either
            self._release()


class CountedRowEngine(CountedByCompletions, NumpyRowEngine):
    """NumpyRowEngine's copies and threads, started with ``start_copy`` and counted (base.CountedCopies)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._counts = Completions()

    def start_copy(self, direction: Direction, src: np.ndarray, dst: np.ndarray, compute: Compute = None) -> int:
        # ``compute`` orders nothing on the host: the caller wrote the "GPU" tensors before it called.
        # The ids are checked by the native copy on the worker (a bad one fails the batch), not here.
        if self._closed:
            raise TransferError(f"start_copy ({direction.value}) on a closed {type(self).__name__}")
        seq = self._counts.issue(direction)
        self._executors[direction].submit(self._copy_counted, direction, seq, src, dst)
        return seq

    def _copy_counted(self, direction: Direction, seq: int, src: np.ndarray, dst: np.ndarray) -> None:
        error = None
        try:
            self._rows.copy(0 if direction is Direction.STORE else 1, src, dst)
        except Exception as exc:  # reported through the counter: the worker never raises
            error = f"{direction.value} of {len(src)} blocks failed: {exc}"
        self._counts.finish(direction, seq, error)



class CountedDirectEngine(DirectCopyEngine):
    """The direct road with its native counters read directly (base.CountedCopies): no loop, no reader."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._started = {d: 0 for d in Direction}
        self._done = {d: 0 for d in Direction}
        self._failed: dict[Direction, dict[int, str]] = {d: {} for d in Direction}

    def start_copy(self, direction: Direction, src: np.ndarray, dst: np.ndarray, compute: Compute = None) -> int:
        if self._closed:
            raise TransferError(f"start_copy ({direction.value}) on a closed {type(self).__name__}")
        ready, raw = self._ready(self._checked(compute))
        d = 0 if direction is Direction.STORE else 1
        seq = int(self._copier.submit(d, src, dst, ready, raw))  # TransferError here: nothing was queued
        with self._lock:
            self._started[direction] = seq
        return seq

    def _collect(self) -> None:
        """Read the native counters (and drain the eventfd): one call for both directions."""
        store_done, load_done, errors = self._copier.poll()
        with self._lock:
            self._done[Direction.STORE], self._done[Direction.LOAD] = int(store_done), int(load_done)
            for d, seq, msg in errors:
                direction = Direction.STORE if d == 0 else Direction.LOAD
                self._failed[direction][int(seq)] = f"direct {direction.value} (call {seq}) failed: {msg}"

    def copies_done(self, direction: Direction) -> tuple[int, dict[int, str]]:
        self._collect()
        with self._lock:
            failed, self._failed[direction] = self._failed[direction], {}
            return self._done[direction], failed

    def wait_copies(self, direction: Direction, seq: int, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._collect()
            if self._done[direction] >= seq:
                return True
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return False
            select.select([self._copier.fd], [], [], left)  # the GIL is released while it sleeps

    def close_copies(self) -> None:
        self._closed = True
        for direction in Direction:
            self.wait_copies(direction, self._started[direction])
        if not self._pending:
            self._release()
