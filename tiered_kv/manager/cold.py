"""Put resident blocks at the cold end: the first to go when a tier needs room, dropped, never spilled.

The tiers' cold list (tier_index.py) already holds what is worth less than anything the policy orders:
copies that also live in a faster tier, the chains of released sessions. ``demote_keys`` puts named
keys there too, in every tier that holds them READY, oldest demoted first to go. A touch (a hit, a
store that finds the key resident) takes a block out again, so a caller that wants a block to stay
cold demotes it after each of those. The vLLM connector's partial tails use it (integrations/vllm/
tails.py): a partial record is dropped before any full block, and before any history is kept for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .loading import key_rows


def demote_keys(manager: Any, keys: Sequence[bytes]) -> int:
    """Move the READY blocks of ``keys`` to the cold end of every tier that holds them (the CPU tier and
    the disk tier below it); keys not held, or held only in flight, are left alone. Returns how many
    blocks were demoted (a key held in both tiers counts twice). Loop thread only, as every manager call."""
    if not len(keys):
        return 0
    rows = key_rows(keys, manager.key_bytes)
    n = 0
    for tier in (manager.cpu, getattr(manager, "disk", None)):
        if tier is None:
            continue
        slots = tier.find_ready(rows)
        slots = np.unique(slots[slots >= 0])  # a repeated key once
        if len(slots):
            tier.demote(slots)
            n += len(slots)
    return n
