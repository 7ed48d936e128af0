"""Reference model of native Tier::plan_store (prepare_store for a tier with nothing below it, one call)."""

from __future__ import annotations

import numpy as np

from tiered_kv.errors import TieredKVError

from .tier_index import _MAX_PINS, EMPTY, FREE, READY, RESERVED


def plan_store(tier, keys: list[bytes], prefix: list[bytes]) -> tuple:
    """(new_idx, slots, evicted key rows, deduped, in_flight), as native; a refusal changes nothing.

    New keys (not READY, not in flight, not repeating an earlier key of the call) get free slots,
    then the victims' (cold first) evicted while the chain's resident blocks and its prefix's are
    pinned, reassigned in ascending order."""
    kb = tier.keys.key_bytes
    found = tier.keys.find(keys) if len(keys) else EMPTY
    seen: set[bytes] = set()
    new_idx, resident = [], []
    deduped = in_flight = 0
    for i, k in enumerate(keys):
        s = int(found[i])
        ready, pending, repeated = s >= 0 and tier.state[s] == READY, s >= 0 and tier.state[s] == RESERVED, k in seen
        seen.add(k)
        deduped += ready or repeated
        in_flight += pending and not repeated
        if ready:
            resident.append(s)
        if not (ready or pending or repeated):
            new_idx.append(i)
    fresh = [keys[i] for i in new_idx]
    m, held = len(fresh), EMPTY
    if m > tier.free_count:
        pre = tier.find_ready(prefix) if len(prefix) else EMPTY
        held = np.unique(np.array(resident + [int(x) for x in pre if x >= 0], dtype=np.int64))
        if np.any(tier.pins[held] == _MAX_PINS):
            raise TieredKVError(f"{tier.name}: more than {_MAX_PINS} concurrent pins on one slot")
    rows = np.zeros((0, kb), dtype=np.uint8)
    slots = tier.reserve(fresh) if m else EMPTY
    got = len(slots)
    answer = lambda s, r: (np.array(new_idx, dtype=np.int64), s, r, deduped, in_flight)  # noqa: E731
    if got == m:
        return answer(slots, rows)
    tier.pin(held)
    try:
        victims = tier.evict(min(m - got, tier.evictable))
    except TieredKVError:  # the reservation goes back as it was taken
        tier.unpin(held)
        tier.keys.remove(slots)
        tier.state[slots] = FREE
        tier.n_reserved -= got
        tier._runs.give(slots)  # the runs are as the reserve found them (a function of the free slots)
        raise
    tier.unpin(held)
    if not len(victims):
        return answer(slots, rows)
    rows = tier.keys.slot_keys[victims].copy()
    victims = np.sort(victims)
    tier.reassign(victims, fresh[got : got + len(victims)])
    return answer(np.concatenate([slots, victims]), rows)
