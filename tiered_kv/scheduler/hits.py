"""The longest hit at which every KV cache group has what it needs (groups.py), and what to load.

Full-attention groups need the whole prefix: their leading resident runs bound the hit. A window or
state group needs only some blocks before the boundary, so the boundary walks down from that bound
to the longest one where every such group has its blocks resident. Only blocks past what vLLM
computed itself (``first``) are loaded.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .groups import FULL, MAMBA, KVGroups


@dataclass
class Hit:
    boundary: int  # blocks computed once loaded
    ranges: list[tuple[int, int]]  # per group: the blocks [a, b) to load
    in_cpu: bool  # every block to load is in the CPU tier
    where: Counter[str]  # blocks to load per tier
    tokens: int = 0  # tokens computed once loaded when the hit ends inside a block (tails.py), else 0
    tail: bytes | None = None  # a partial tail's key, loaded into the last block of ranges[0] (tails.py)

    @property
    def blocks(self) -> int:
        return sum(b - a for a, b in self.ranges)


def find_hit(cache: Any, groups: KVGroups, keys: list[list[bytes]], first: int, max_blocks: int,
             unit: int) -> Hit | None:  # fmt: skip
    """On the cache's loop. None: no boundary past ``first`` has every group's blocks. ``first``,
    ``max_blocks`` and the boundary count hit units of ``unit`` tokens (groups.py); ranges are each
    group's own blocks."""
    bound = max_blocks
    looked: dict[int, Any] = {}
    for p, g in enumerate(groups.groups):
        if g.kind == FULL:  # in-flight stores count: a load waits for them
            looked[p] = cache.lookup(keys[p][: g.blocks(max_blocks, unit)])
            bound = min(bound, looked[p].total // g.blocks(1, unit))
    if bound <= first:
        return None
    runs: dict[int, list[int]] = {}  # window/state groups: resident run length ending at each block
    for p, g in enumerate(groups.groups):
        if g.kind != FULL:
            run, runs[p] = 0, []
            for tier in cache.tiers_of(keys[p][: g.blocks(bound, unit)]):
                run = run + 1 if tier else 0
                runs[p].append(run)
    boundary = bound
    while boundary > first and not all(_covered(g, runs[p], boundary, first, unit)
                                       for p, g in enumerate(groups.groups) if g.kind != FULL):  # fmt: skip
        boundary -= 1
    if boundary <= first:
        return None
    ranges = []
    for g in groups.groups:
        need = g.needed(boundary, unit)
        ranges.append((max(need.start, g.blocks(first, unit)), need.stop))
    hit = Hit(boundary, ranges, True, Counter())
    for p, (a, b) in enumerate(ranges):
        if b <= a:
            continue
        if p in looked and looked[p].cpu >= b:
            hit.where["cpu"] += b - a
            continue
        tiers = cache.tiers_of(keys[p][a:b])
        hit.where.update(t for t in tiers)
        hit.in_cpu = hit.in_cpu and all(t == "cpu" for t in tiers)
    # A Mamba state is never loaded in the step that computes after it: in align mode vLLM's model runner
    # copies the boundary's state into the block the forward writes (preprocess_mamba) before
    # start_load_kv runs, so a synchronous load would land after the copy read zeros. Asynchronous, it
    # lands before the request is scheduled to compute.
    #
    # A hit of several KV cache groups is always asynchronous: vLLM 0.32 takes a hybrid model's load
    # failures only as whole requests waiting for their load (failed_recving); a synchronous load that
    # failed (the byte budget taken group by group, a block gone since the lookup, a copy error) would
    # have no way to say so, and block ids kill its EngineCore (_handle_invalid_blocks).
    mamba = any(g.kind == MAMBA for g in groups.groups)
    hit.in_cpu = hit.in_cpu and not mamba and not groups.hybrid and cache.copies_now(hit.blocks)
    return hit


def _covered(g: Any, run: list[int], boundary: int, first: int, unit: int) -> bool:
    need = g.needed(boundary, unit)
    a = max(need.start, g.blocks(first, unit))
    return a >= need.stop or run[need.stop - 1] >= need.stop - a


def touch_hit(cache: Any, groups: KVGroups, keys: list[list[bytes]], hit: Hit, session: Any,
              expect_followup: bool) -> None:  # fmt: skip
    """The promised blocks are the last to go: a prefix's whole chain (head most recent, as ``touch``
    orders it), a window's blocks."""
    for p, g in enumerate(groups.groups):
        a, b = hit.ranges[p]
        if b > a:
            cache.touch(keys[p][: b] if g.kind == FULL else keys[p][a:b], session=session,
                        expect_followup=expect_followup)  # fmt: skip
