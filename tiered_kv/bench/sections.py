"""Timed sections around the entry points of a call's parts, without a profiler (call_cost's second view).

cProfile's shares (call_cost.profile_parts) overweight code made of many small calls, since the
profiler's cost is per call. ``Sections`` instead times only the entry points, on the loop thread's CPU
clock as the call itself is timed (less the clock's own cost): the argument checks (``check_blocks`` or ``call_blocks``, ``compute_for``, as cache.py calls them), the manager's planning
and commit, and the metrics' per-call updates. It patches one cache's manager and
metrics instances and cache.py's two checks for the duration; ``restore`` undoes every patch.
"""

from __future__ import annotations

import time
from typing import Any

from .. import cache as cache_module

SECTION_NAMES = ("args", "plan", "commit", "metrics")


class Sections:
    def __init__(self, cache: Any) -> None:
        self.seconds = dict.fromkeys(SECTION_NAMES, 0.0)
        self.counts = dict.fromkeys(SECTION_NAMES, 0)
        self.overhead = _clock_cost()
        self._undo: list[tuple[Any, str, Any, bool]] = []
        for name, part in (("prepare_store", "plan"), ("prepare_load", "plan"), ("complete_store", "commit"),
                           ("complete_load", "commit")):  # fmt: skip
            self._wrap(cache.manager, name, part)
        for name in ("moved", "store_slots"):
            self._wrap(cache.metrics, name, "metrics")
        for child in cache.metrics.op_latency.values():
            self._wrap(child, "observe", "metrics")
        for name in ("check_blocks", "call_blocks", "compute_for"):  # whichever cache.py calls (call_blocks wraps
            if hasattr(cache_module, name):  # check_blocks where cache.py has it)
                self._wrap(cache_module, name, "args")

    def _wrap(self, owner: Any, name: str, part: str) -> None:
        orig = getattr(owner, name)
        seconds, counts = self.seconds, self.counts
        clock = time.thread_time  # not perf_counter: the disk's threads preempt the loop, and that is not its cost

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                seconds[part] += clock() - t0
                counts[part] += 1

        self._undo.append((owner, name, orig, name in vars(owner)))
        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """Seconds per section since the last take, less the clock's own cost (one read per timed call)."""
        out = {k: max(0.0, v - self.counts[k] * self.overhead) for k, v in self.seconds.items()}
        for k in self.seconds:
            self.seconds[k], self.counts[k] = 0.0, 0
        return out

    def restore(self) -> None:
        for owner, name, orig, own in reversed(self._undo):
            if own:  # a module global (or an attribute the instance held itself)
                setattr(owner, name, orig)
            else:  # a method: drop the instance's shadow
                delattr(owner, name)
        self._undo.clear()


def _clock_cost(reads: int = 2000) -> float:
    """Seconds one ``thread_time`` read adds to a section (it is a system call, about 0.5-1 us)."""
    clock = time.thread_time
    t0 = clock()
    for _ in range(reads):
        clock()
    return (clock() - t0) / reads

