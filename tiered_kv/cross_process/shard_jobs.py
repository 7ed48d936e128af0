"""A copy job as the scheduler sends it to every TP rank (in the step's metadata: vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STORE, LOAD = "store", "load"  # GPU -> CPU slots, CPU slots -> GPU


@dataclass(frozen=True)
class ShardJob:
    """Copy GPU blocks ``gpu_ids[i]`` to or from CPU slot ``cpu_slots[i]``.

    Every rank gets the same job and copies only its own shard of each slot; ``job_id`` is assigned
    by the scheduler and is what a rank reports back. Picklable (vLLM ships metadata between processes).
    """

    job_id: int
    direction: str
    gpu_ids: np.ndarray
    cpu_slots: np.ndarray
    req_id: str | None = None

    def __len__(self) -> int:
        return len(self.gpu_ids)
