"""The media a block moves between, and a job's route (source, destination): what the dispatcher
(transfer/handlers/dispatch.py) keys its handlers by and the metrics name each direction by."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Medium(str, Enum):
    GPU = "gpu"
    CPU = "cpu"  # the CPU slab: the CPU tier's slots and an exclusive load's staging rows
    DISK = "disk"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class Route:
    """Where a job's blocks come from and go to. CPU -> CPU: rows restaged within the slab (no tier
    changes, so the dispatcher counts no move for it)."""

    src: Medium
    dst: Medium
    # Derived once (a route is looked at on every copy): the direction's metrics label
    # (``tiered_kv_blocks_moved_total{gpu_to_cpu}``), and whether it moves blocks between tiers.
    name: str = field(init=False, compare=False, repr=False)
    moves: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", f"{self.src.value}_to_{self.dst.value}")
        object.__setattr__(self, "moves", self.src is not self.dst)


GPU_TO_CPU = Route(Medium.GPU, Medium.CPU)
CPU_TO_GPU = Route(Medium.CPU, Medium.GPU)
CPU_TO_DISK = Route(Medium.CPU, Medium.DISK)
DISK_TO_CPU = Route(Medium.DISK, Medium.CPU)
CPU_TO_REMOTE = Route(Medium.CPU, Medium.REMOTE)
REMOTE_TO_CPU = Route(Medium.REMOTE, Medium.CPU)
RESTAGE = Route(Medium.CPU, Medium.CPU)

# The routes between tiers, in the order the metrics list them (a new tier adds its two here).
MOVES = (GPU_TO_CPU, CPU_TO_GPU, CPU_TO_DISK, DISK_TO_CPU, CPU_TO_REMOTE, REMOTE_TO_CPU)
