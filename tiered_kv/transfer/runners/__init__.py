"""The execute phase: each runner takes a plan from the tier manager, runs its jobs in order through
the dispatcher (transfer/handlers/), and hands the outcome back to the manager to finish.

store.py (GPU -> CPU, after the spills of the slots it reuses), load.py (disk and Redis reads into
CPU slots, then CPU -> GPU, chunk by chunk), spill.py (CPU -> disk and CPU -> Redis), control.py
(a call's control state, and how its caller waits for it under the cancel contract).
"""

from .control import MoveControl, Progress, ThreadedCopyFuture, run_move
from .load import LoadRunner
from .spill import SpillRunner
from .store import StoreResult, StoreRunner

__all__ = [
    "LoadRunner",
    "MoveControl",
    "Progress",
    "SpillRunner",
    "StoreResult",
    "StoreRunner",
    "ThreadedCopyFuture",
    "run_move",
]
