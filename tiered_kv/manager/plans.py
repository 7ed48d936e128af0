"""What the tier manager hands the runners (transfer/runners/): batches of slots and ids, never an object per block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..media import CPU_TO_DISK, DISK_TO_CPU, Route
from .tier_index import EMPTY


class Located(NamedTuple):
    """Where each key is in the local tiers (``TierManager.locate``)."""

    cpu: np.ndarray  # CPU slot, any state; -1 if absent
    cpu_ready: np.ndarray
    disk: np.ndarray  # disk slot, any state, of a key with no CPU entry; -1 otherwise
    disk_ready: np.ndarray
    pending: np.ndarray  # in flight: RESERVED in the CPU tier, or in the disk tier (being spilled)


@dataclass(frozen=True)
class LookupResult:
    """Leading run of keys the caller can load, split by where each one is.

    ``total = cpu + disk + pending + remote``. ``pending`` keys are still being stored,
    spilled or promoted by another call: ``load`` waits for them (and stops at
    one whose copy fails), so they count as hits the caller can wait for.
    """

    total: int = 0
    cpu: int = 0
    disk: int = 0
    pending: int = 0
    remote: int = 0  # believed in the remote tier (a load that finds one gone stops there: a miss)

    @property
    def in_flight(self) -> bool:
        """True when part of the run is still in flight (``load`` or ``wait_for`` waits for it)."""
        return self.pending > 0


@dataclass
class SpillJob:
    """CPU -> disk: ``keys`` (rows ``[n, key_bytes]``) from ``cpu_slots`` into reserved ``disk_slots``.

    ``reuse`` is True for eviction spills: the CPU slots already belong to new
    keys, whose copy must wait until this job has read them. Write-through
    spills (``reuse`` False) hold a pin on their CPU slots instead.
    """

    keys: np.ndarray
    cpu_slots: np.ndarray
    disk_slots: np.ndarray
    reuse: bool
    media: Route = CPU_TO_DISK  # or CPU_TO_REMOTE (its disk_slots are empty)

    def __len__(self) -> int:
        return len(self.cpu_slots)


@dataclass(slots=True)  # one per store call: slots make it cheaper to build
class StorePlan:
    """GPU -> CPU for the new keys of a store call, after ``spill`` (if any) has read the reused slots."""

    keys: list[bytes]  # every key of the call, for the touch order at completion
    gpu_ids: np.ndarray  # their GPU blocks
    cpu_slots: np.ndarray  # their reserved CPU slots
    spill: SpillJob | None = None
    deduped: int = 0  # already resident (or repeated in the call): touched, not copied
    in_flight: int = 0  # another store or promotion of the key is in flight
    unplaced_idx: np.ndarray = field(default_factory=lambda: EMPTY)  # call positions of new keys with no slot
    prefix: list[bytes] = field(default_factory=list)  # the chain before keys[0]: touched with them
    remote_spill: SpillJob | None = None  # write-back of the victims to the remote tier, before reuse

    @property
    def must_wait(self) -> bool:
        """Its copy must wait for I/O: the reused slots' old blocks are written out first."""
        return self.spill is not None or self.remote_spill is not None

    @property
    def unplaced(self) -> int:
        """New keys no slot could be found for (everything else pinned or in flight): the trailing ones."""
        return len(self.unplaced_idx)


@dataclass
class PromoteJob:
    """disk -> CPU: verified reads of ``keys`` from ``disk_slots`` (pinned) into reserved ``cpu_slots``."""

    keys: np.ndarray
    disk_slots: np.ndarray
    cpu_slots: np.ndarray
    positions: np.ndarray  # index of each promoted key within the load plan's run
    media: Route = DISK_TO_CPU  # or REMOTE_TO_CPU (its disk_slots are empty)

    def __len__(self) -> int:
        return len(self.cpu_slots)


@dataclass
class LoadPlan:
    """CPU -> GPU for a leading run of keys; disk hits are promoted into CPU slots first.

    ``stop`` says why the run ended before the end of the call: "miss", "in_flight"
    (a key is being stored or promoted by another call: wait for it and plan again
    from ``len(cpu_slots)``), "room" (no CPU slot for the next disk hit: load this
    chunk, then plan again), or "" (the run reached the end of the call).
    """

    cpu_slots: np.ndarray = field(default_factory=lambda: EMPTY)  # source slot per key of the run (pinned)
    promote: PromoteJob | None = None  # from disk
    spill: SpillJob | None = None  # victims of the promotions' CPU slots, written first
    stop: str = ""
    pinned: np.ndarray = field(default_factory=lambda: EMPTY)  # CPU slots this plan holds a pin on
    exclusive: bool = False  # the engine keeps what it loads and stores it back: demote the CPU copies
    fetch: PromoteJob | None = None  # from the remote tier (its disk_slots are empty)
    staged: np.ndarray = field(default_factory=lambda: EMPTY)  # staging rows of an exclusive load
    restage: tuple[np.ndarray, np.ndarray] | None = None  # CPU hits -> their staging rows (copied first)
    remote_spill: SpillJob | None = None  # write-back to the remote tier of the same victims

    @property
    def must_wait(self) -> bool:
        """Its copy must wait for I/O first: reads into CPU slots, the spills they imply, a restage."""
        return (
            self.promote is not None
            or self.fetch is not None
            or self.spill is not None
            or self.restage is not None
            or self.remote_spill is not None
        )

    def __len__(self) -> int:
        return len(self.cpu_slots)
