"""The execute phase: each runner takes a plan from the tier manager, runs its jobs in order through
the dispatcher (transfer/handlers/), and hands the outcome back to the manager to finish.

store.py (GPU -> CPU, after the spills of the slots it reuses), load.py (disk and Redis reads into
CPU slots, then CPU -> GPU, chunk by chunk), spill.py (CPU -> disk and CPU -> Redis), control.py
(a call's control state, and how its caller waits for it under the cancel contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...manager import TierManager
from ...metrics import CacheMetrics
from ...owned_tasks import TaskSet
from ..handlers import DiskIO, Dispatcher
from .control import MoveControl, Progress, ThreadedCopyFuture, run_move
from .load import LoadRunner
from .spill import SpillRunner
from .store import StoreResult, StoreRunner

__all__ = [
    "LoadRunner",
    "MoveControl",
    "Progress",
    "Runners",
    "SpillRunner",
    "StoreResult",
    "StoreRunner",
    "ThreadedCopyFuture",
    "run_move",
]


@dataclass(frozen=True)
class Runners:
    """The three runners over one manager: stores and loads spill through ``spills``."""

    spills: SpillRunner
    stores: StoreRunner
    loads: LoadRunner

    @classmethod
    def build(
        cls,
        manager: TierManager,
        dispatcher: Dispatcher,
        metrics: CacheMetrics,
        tasks: TaskSet,
        progress: Progress,
        *,
        max_promote: int,
        disk: DiskIO | None,
        remote: Any,
    ) -> Runners:
        """``disk``/``remote``: the disk and remote tiers' I/O (handlers), None where a tier is off;
        the other arguments as each runner's constructor takes them."""
        spills = SpillRunner(manager, dispatcher, metrics, tasks, progress, disk=disk, remote=remote)
        stores = StoreRunner(
            manager, dispatcher, metrics, spills, tasks, progress, remote_writes=remote is not None
        )
        loads = LoadRunner(manager, dispatcher, spills, tasks, progress, max_promote=max_promote)
        return cls(spills, stores, loads)
