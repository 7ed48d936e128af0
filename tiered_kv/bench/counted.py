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
    """Host seconds spent inside ``engine.submit_store``/``submit_load`` (the engine's share of a call), and the
    CPU slots each call named. Wraps the bound methods of one engine instance; ``restore`` undoes it."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.seconds = 0.0
        self.calls = 0
        self._slots = {d: deque(maxlen=4096) for d in Direction}  # each call's CPU slots, as given
        self._orig = {"submit_store": engine.submit_store, "submit_load": engine.submit_load}
        engine.submit_store = self._wrap(self._orig["submit_store"], Direction.STORE)  # type: ignore[method-assign]
        engine.submit_load = self._wrap(self._orig["submit_load"], Direction.LOAD)  # type: ignore[method-assign]

    def _wrap(self, submit, direction: Direction):
        def timed(src, dst, *, compute: Compute = None) -> CopyHandle:
            t0 = time.perf_counter()
            try:
                return submit(src, dst, compute=compute)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._slots[direction].append(dst if direction is Direction.STORE else src)  # runs: counted later

        return timed

    def slot_runs(self, direction: Direction, last: int | None = None) -> list[int]:
        """Runs of consecutive slots (in slot order, as the engines copy them) of each call in ``direction`` (the ``last`` ones), counted outside the timed calls."""
        calls = list(self._slots[direction])[-last:] if last else self._slots[direction]
        return [slot_runs(np.asarray(s, dtype=np.int64)) for s in calls]

    def take(self) -> float:
        """Seconds since the last take."""
        s, self.seconds = self.seconds, 0.0
        return s

    def restore(self) -> None:
        for name in self._orig:
            delattr(self.engine, name)
