"""A copy engine whose submit is counted, not run: the cache's own per-call cost with no bytes moving.

``CountedEngine`` is a real ``CopyEngine``: the base class checks the ids exactly as every engine does,
then ``_launch`` records the call (its direction, block count, runs of slots and host time) and
completes the batch on the next loop turn, as a CUDA copy's completion arrives (minus the waiter
thread's hop, which is the engine's). It offers no ``copy_inline``, so the cache takes the awaited path
the CUDA engines take. ``SubmitClock`` wraps any engine's ``submit_*`` to split a call's host time into
the engine's share and the cache's.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from ..metrics import slot_runs
from ..transfer.engines.base import Compute, CopyEngine, CopyHandle, Direction


class CountedEngine(CopyEngine):
    """Records each batch and completes it at once (``call_soon``); moves nothing."""

    copy_path = "counted"

    def __init__(self, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor]) -> None:
        super().__init__(gpu_regions, cpu_regions)
        self.calls = {d: 0 for d in Direction}
        self.blocks = {d: 0 for d in Direction}

    def _launch(self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
                loop: asyncio.AbstractEventLoop, compute: Compute) -> None:  # fmt: skip
        self.calls[direction] += 1
        self.blocks[direction] += len(src)
        loop.call_soon(self._resolve, handle.future, None)

    def _release(self) -> None:
        pass


class SubmitClock:
    """Host seconds spent inside the engine's entry points (the engine's share of a call), and the CPU slots each
    call named. Wraps ``submit_store``/``submit_load`` and, where the engine has them, the host engine's
    ``copy_inline`` (which copies before it returns: its share then holds the memcpy) and ``copy_threaded``.
    Patches the bound methods of one engine instance; install it before the cache registers the engine (in the
    ``engine_factory``): the handlers keep the methods they found then. ``restore`` undoes it."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.seconds = 0.0
        self.calls = 0
        self._slots = {d: deque(maxlen=4096) for d in Direction}  # each call's CPU slots, as given
        self._orig = {}
        for name, direction in (("submit_store", Direction.STORE), ("submit_load", Direction.LOAD)):
            self._orig[name] = getattr(engine, name)
            setattr(engine, name, self._wrap_submit(self._orig[name], direction))
        for name in ("copy_inline", "copy_threaded"):
            if getattr(engine, name, None) is not None:
                self._orig[name] = getattr(engine, name)
                setattr(engine, name, self._wrap_copy(self._orig[name]))

    def _note(self, t0: float, direction: Direction, src, dst) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self._slots[direction].append(dst if direction is Direction.STORE else src)  # runs: counted later

    def _wrap_submit(self, submit, direction: Direction):
        def timed(src, dst, *, compute: Compute = None) -> CopyHandle:
            t0 = time.perf_counter()
            try:
                return submit(src, dst, compute=compute)
            finally:
                self._note(t0, direction, src, dst)

        return timed

    def _wrap_copy(self, copy):
        def timed(direction: Direction, src, dst, *args):
            t0 = time.perf_counter()
            done = False
            try:
                done = copy(direction, src, dst, *args)
                return done
            finally:
                if done is not False:  # copy_inline declined: the call goes on to another entry point
                    self._note(t0, direction, src, dst)
                else:
                    self.seconds += time.perf_counter() - t0

        return timed

    def slot_runs(self, direction: Direction, last: int | None = None) -> list[int]:
        """Runs of consecutive slots (in slot order, as the engines copy them) of each call in ``direction`` (the
        ``last`` ones), counted here, outside the timed calls."""
        calls = list(self._slots[direction])[-last:] if last else self._slots[direction]
        return [slot_runs(np.asarray(s, dtype=np.int64)) for s in calls]

    def take(self) -> float:
        """Seconds since the last take."""
        s, self.seconds = self.seconds, 0.0
        return s

    def restore(self) -> None:
        for name in self._orig:
            delattr(self.engine, name)
