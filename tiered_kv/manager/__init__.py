"""The synchronous tier manager: indexes, policies, pins and placement, no I/O and no awaits.

The plan and finish phases of every move: transfer/ executes what it plans."""

from .manager import EVENT_KINDS, TierManager
from .plans import LoadPlan, LookupResult, PromoteJob, SpillJob, StorePlan
from .tier_index import FREE, READY, RESERVED, TierIndex

__all__ = [
    "EVENT_KINDS",
    "FREE",
    "READY",
    "RESERVED",
    "LoadPlan",
    "LookupResult",
    "PromoteJob",
    "SpillJob",
    "StorePlan",
    "TierIndex",
    "TierManager",
]
