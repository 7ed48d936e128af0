"""Timed sections around the entry points of a call's parts, without a profiler (call_cost's second view).

cProfile's shares (call_cost.profile_parts) overweight code made of many small calls, since the
profiler's cost is per call. ``Sections`` instead times only the entry points, with ``perf_counter``:
the argument checks (``check_blocks`` or ``call_blocks``, ``compute_for``, as cache.py calls them), the manager's planning
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
        seconds = self.seconds
        clock = time.perf_counter  # 0.09 us a read; the thread's CPU clock costs 0.85 (a syscall)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                seconds[part] += clock() - t0

        self._undo.append((owner, name, orig, name in vars(owner)))
        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        """Seconds per section since the last take."""
        out = dict(self.seconds)
        for k in self.seconds:
            self.seconds[k] = 0.0
        return out

    def restore(self) -> None:
        for owner, name, orig, own in reversed(self._undo):
            if own:  # a module global (or an attribute the instance held itself)
                setattr(owner, name, orig)
            else:  # a method: drop the instance's shadow
                delattr(owner, name)
        self._undo.clear()
