"""In-process single-tier cache simulators: the yardsticks a replay is compared with.

Semantics (as ../shared/data/README.md defines them, block-weighted, prefix hits):

* A request hits only the longest run of cached blocks from its start: a cached
  block after the first miss is recomputed anyway, so it does not count.
* After the lookup, all the request's blocks are inserted or touched, last block
  first, so the head of the request ends up most recent (it is the part that the
  next turn of a conversation shares).

Belady is MIN with bypass, next use counted in block references (the flat stream
of every request's hash_ids in order): on a miss in a full cache the block with the
farthest next use is evicted -- and that may be the block being inserted, which is
then simply not admitted. Ties occur only between never-used-again blocks, so the
hit count does not depend on tie-breaking. These rules reproduce the reference
table for the Mooncake synthetic trace to 0.01 points.

``drop_partial=True`` never inserts a request's last block when ``input_length``
is not a multiple of ``block_tokens`` (a partial block is never reused as such,
so storing it only costs a slot). The block still counts as a reference, may
still hit, and is touched if some other request stored it whole.

``simulate_policy`` drives the real policy classes (``tiered_kv.replay.policies``) over a
flat cache, one batch per request, the way the tier manager does: the request's
resident blocks are pinned while the evictions its new blocks need are taken
(all at once, before any insert), then the request's blocks, last block first,
are inserted (new) or touched (resident) in runs, so the batch acts as its
blocks one by one in that order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiered_kv.errors import ConfigError
from tiered_kv.replay.policies import make_policy
from tiered_kv.replay.trace import Request

__all__ = [
    "SimResult",
    "prefix_hits",
    "simulate_belady",
    "simulate_lru",
    "simulate_policy",
    "simulate_unbounded",
    "unique_blocks",
]


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulation; hit_rate is hit_blocks / block_refs."""

    policy: str
    capacity_blocks: int
    requests: int
    block_refs: int
    hit_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.block_refs if self.block_refs else 0.0


def _check_capacity(capacity_blocks: int) -> None:
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
        raise ConfigError(f"capacity_blocks must be a non-negative integer, got {capacity_blocks!r}")


def _check_block_tokens(block_tokens: int) -> None:
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ConfigError(f"block_tokens must be a positive integer, got {block_tokens!r}")


def _dropped(r: Request, drop_partial: bool, block_tokens: int) -> int:
    """How many trailing blocks of ``r`` are never inserted: 1 for a partial last block when dropping."""
    return int(drop_partial and bool(r.hash_ids) and r.input_length % block_tokens != 0)


def prefix_hits(hash_ids: Sequence[int], cached) -> int:
    """Length of the longest run of ``hash_ids`` from the start that is in ``cached``."""
    n = 0
    for h in hash_ids:
        if h not in cached:
            break
        n += 1
    return n


def unique_blocks(requests: Sequence[Request]) -> int:
    """Number of distinct block ids referenced by ``requests``."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.hash_ids)
    return len(seen)


def _block_refs(requests: Sequence[Request]) -> int:
    return sum(len(r.hash_ids) for r in requests)


def simulate_unbounded(requests: Sequence[Request]) -> SimResult:
    """Hit rate with infinite capacity; capacity_blocks reports the unique-block count."""
    seen: set[int] = set()
    hits = 0
    for r in requests:
        hits += prefix_hits(r.hash_ids, seen)
        seen.update(r.hash_ids)
    return SimResult("unbounded", len(seen), len(requests), _block_refs(requests), hits)


def simulate_lru(
    requests: Sequence[Request], capacity_blocks: int, *, drop_partial: bool = False, block_tokens: int = 512
) -> SimResult:
    """Single-tier LRU of ``capacity_blocks`` blocks under prefix semantics."""
    _check_capacity(capacity_blocks)
    _check_block_tokens(block_tokens)
    cache: OrderedDict[int, None] = OrderedDict()  # oldest first
    hits = 0
    for r in requests:
        hits += prefix_hits(r.hash_ids, cache)
        if capacity_blocks == 0:
            continue
        ids = r.hash_ids
        keep = len(ids) - _dropped(r, drop_partial, block_tokens)
        # Last block first: when a request is longer than the cache, its head survives.
        for j in range(len(ids) - 1, -1, -1):
            h = ids[j]
            if h in cache:
                cache.move_to_end(h)
            elif j < keep:
                cache[h] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    name = "lru+drop_partial" if drop_partial else "lru"
    return SimResult(name, capacity_blocks, len(requests), _block_refs(requests), hits)


def _next_uses(requests: Sequence[Request], never: int) -> list[list[int]]:
    """For every reference, the flat position of the same block's next reference (or ``never``)."""
    starts: list[int] = []
    pos = 0
    for r in requests:
        starts.append(pos)
        pos += len(r.hash_ids)
    nxt: list[list[int]] = [[]] * len(requests)
    last: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        ids = requests[i].hash_ids
        base = starts[i]
        row = [never] * len(ids)
        # Walk the request backwards too, so a block repeated inside one request
        # points at its next occurrence, not past it.
        for j in range(len(ids) - 1, -1, -1):
            h = ids[j]
            row[j] = last.get(h, never)
            last[h] = base + j
        nxt[i] = row
    return nxt


def simulate_belady(
    requests: Sequence[Request], capacity_blocks: int, *, drop_partial: bool = False, block_tokens: int = 512
) -> SimResult:
    """Offline optimum (MIN with bypass): evict the block whose next use is farthest.

    Never-used-again blocks go first and are not admitted into a full cache. The
    next uses are precomputed; a max-heap with lazy invalidation finds the victim
    (an entry is live only while ``cache[block]`` still equals its next use).
    With ``drop_partial`` a partial last block is never admitted (touched if resident).
    """
    _check_capacity(capacity_blocks)
    _check_block_tokens(block_tokens)
    refs = _block_refs(requests)
    never = refs + 1  # later than any real position
    nxt = _next_uses(requests, never)
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next_use, block), possibly stale
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for r, row in zip(requests, nxt, strict=True):
        ids = r.hash_ids
        hits += prefix_hits(ids, cache)
        if capacity_blocks == 0:
            continue
        keep = len(ids) - _dropped(r, drop_partial, block_tokens)
        for j in range(len(ids) - 1, -1, -1):
            h, nu = ids[j], row[j]
            if h not in cache:
                if j >= keep:
                    continue  # a dropped partial block is never admitted
                if len(cache) >= capacity_blocks:
                    while cache.get(heap[0][1]) != -heap[0][0]:
                        pop(heap)  # stale entry: the block was touched or evicted since
                    if nu >= -heap[0][0]:
                        continue  # the new block itself is the farthest: bypass it
                    del cache[pop(heap)[1]]
            cache[h] = nu
            push(heap, (-nu, h))
    name = "belady+drop_partial" if drop_partial else "belady"
    return SimResult(name, capacity_blocks, len(requests), refs, hits)


class _FlatCache:
    """A flat cache of slots whose eviction order comes from a real policy object."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.tags = np.zeros(capacity, dtype=np.uint64)  # the block id each slot holds: the ghosts' tag
        self.policy = make_policy(policy, capacity, key_tag=self.tags.__getitem__)
        self.where: dict[int, int] = {}  # block id -> slot
        self.block = [0] * capacity  # slot -> block id
        self.free = list(range(capacity - 1, -1, -1))
        self.pins = np.zeros(capacity, dtype=np.uint8)

    def store(self, rev: list[int], keep: list[bool]) -> None:
        """Insert or touch ``rev`` (a request's blocks, last first) as one batch; ``keep``: may be inserted."""
        where = self.where
        res = [where[h] for h in rev if h in where]
        new: dict[int, None] = {}  # insertion-ordered and deduplicated: a repeat is a touch
        for h, k in zip(rev, keep, strict=True):
            if k and h not in where:
                new[h] = None
        short = len(new) - len(self.free)
        if short > 0:
            self.pins[res] = 1  # what the request itself holds is not evicted for its own blocks
            n = min(short, len(self.policy) - int(np.count_nonzero(self.pins)))
            victims = self.policy.evict(n, self.pins).tolist() if n > 0 else []
            self.pins[res] = 0
            for v in victims:
                del where[self.block[v]]
            self.free.extend(victims)
        skip = set(list(new)[: max(0, len(new) - len(self.free))])  # no room: the tail goes, the head stays
        runs: list[tuple[bool, list[int]]] = []
        for h in rev:
            if h in new and h not in skip:
                slot = self.free.pop()
                where[h] = slot
                self.block[slot] = h
                self.tags[slot] = h
                del new[h]
                is_new = True
            elif h in where:
                slot, is_new = where[h], False
            else:
                continue
            if runs and runs[-1][0] == is_new:
                runs[-1][1].append(slot)
            else:
                runs.append((is_new, [slot]))
        for is_new, slots in runs:
            (self.policy.insert if is_new else self.policy.touch)(np.array(slots, dtype=np.int64))


def simulate_policy(
    requests: Sequence[Request],
    capacity_blocks: int,
    policy: str,
    *,
    drop_partial: bool = False,
    block_tokens: int = 512,
) -> SimResult:
    """A flat cache of ``capacity_blocks`` slots ordered by the policy ``make_policy(policy)`` builds.

    Same prefix semantics as ``simulate_lru``; see the module docstring for how a
    request becomes policy calls. Unknown policy names raise ConfigError.
    """
    _check_capacity(capacity_blocks)
    _check_block_tokens(block_tokens)
    cache = _FlatCache(capacity_blocks, policy)
    hits = 0
    for r in requests:
        ids = r.hash_ids
        hits += prefix_hits(ids, cache.where)
        if capacity_blocks == 0 or not ids:
            continue
        keep = len(ids) - _dropped(r, drop_partial, block_tokens)
        cache.store(list(reversed(ids)), [j < keep for j in range(len(ids) - 1, -1, -1)])
    name = f"{policy.lower()}+drop_partial" if drop_partial else policy.lower()
    return SimResult(name, capacity_blocks, len(requests), _block_refs(requests), hits)
