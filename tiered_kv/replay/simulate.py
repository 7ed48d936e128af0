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
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tiered_kv.errors import ConfigError
from tiered_kv.replay.trace import Request

__all__ = [
    "SimResult",
    "prefix_hits",
    "simulate_belady",
    "simulate_lru",
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


def simulate_lru(requests: Sequence[Request], capacity_blocks: int) -> SimResult:
    """Single-tier LRU of ``capacity_blocks`` blocks under prefix semantics."""
    _check_capacity(capacity_blocks)
    cache: OrderedDict[int, None] = OrderedDict()  # oldest first
    hits = 0
    for r in requests:
        hits += prefix_hits(r.hash_ids, cache)
        if capacity_blocks == 0:
            continue
        # Last block first: when a request is longer than the cache, its head survives.
        for h in reversed(r.hash_ids):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return SimResult("lru", capacity_blocks, len(requests), _block_refs(requests), hits)


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


def simulate_belady(requests: Sequence[Request], capacity_blocks: int) -> SimResult:
    """Offline optimum (MIN with bypass): evict the block whose next use is farthest.

    Never-used-again blocks go first and are not admitted into a full cache. The
    next uses are precomputed; a max-heap with lazy invalidation finds the victim
    (an entry is live only while ``cache[block]`` still equals its next use).
    """
    _check_capacity(capacity_blocks)
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
        for j in range(len(ids) - 1, -1, -1):
            h, nu = ids[j], row[j]
            if h not in cache and len(cache) >= capacity_blocks:
                while cache.get(heap[0][1]) != -heap[0][0]:
                    pop(heap)  # stale entry: the block was touched or evicted since
                if nu >= -heap[0][0]:
                    continue  # the new block itself is the farthest: bypass it
                del cache[pop(heap)[1]]
            cache[h] = nu
            push(heap, (-nu, h))
    return SimResult("belady", capacity_blocks, len(requests), refs, hits)
