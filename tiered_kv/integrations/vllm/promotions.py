"""Disk and Redis hits promoted into the CPU tier before vLLM gives them GPU blocks (issue 39 item 3).

An asynchronous load holds the request's GPU blocks (WAITING_FOR_REMOTE_KVS) while the disk or Redis
reads run. Instead, a hit that is not all in the CPU tier first has its blocks read into CPU slots
(``TieredKVCache.promote``: a load's reads and spills, no GPU copy), started on the cache's loop and
not waited for, while ``get_num_new_matched_tokens`` answers ``None``: vLLM skips the request this
step and asks again the next, allocating nothing. Once the promotion has ended the hit is looked up
again and, all in the CPU tier now, served as a synchronous CPU hit in that step (loads.py).

Bounds: one promotion per request (``Promotions.start`` refuses a second), so a hit that is still not
all in the CPU tier after it (blocks evicted meanwhile, a failed read, a CPU tier smaller than the
hit, a byte budget with no room) is answered as before: an asynchronous load of what is resident, and
a request is never skipped forever. A request that finishes or is aborted while promoting is
forgotten and its promotion cancelled (the cache's cancel contract: it returns once nothing it holds
is left); blocks it already read stay in the CPU tier as any other resident block.

A hybrid model (several KV cache groups) and blocks still being stored by another request keep the
asynchronous load: a hybrid hit is never served synchronously (hits.py), and a store in flight lands
through its own reports.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ...scheduler.hits import Hit
from ...scheduler.tails import load_parts

log = logging.getLogger(__name__)

PROMOTED_TIERS = ("disk", "remote")


class Promotions:
    """The promotions in flight, one per request at most (module docstring)."""

    def __init__(self, counters: Counter[str], *, enabled: bool = True) -> None:
        self._counters = counters
        self._enabled = enabled
        self._running: dict[str, concurrent.futures.Future] = {}
        self._done: set[str] = set()  # requests whose one promotion has ended

    def waiting(self, rid: str) -> bool:
        """True while the request's promotion runs (vLLM is answered None); False once it ended."""
        future = self._running.get(rid)
        if future is None:
            return False
        if not future.done():
            return True
        del self._running[rid]
        self._done.add(rid)
        try:
            self._counters["promoted_blocks"] += int(future.result())
        except BaseException as exc:  # a failed promotion: the hit is served as resident now
            log.warning("tiered_kv: a promotion for %s failed: %r", rid, exc)
            self._counters["failed_promotions"] += 1
        return False

    def wanted(self, rid: str, hit: Hit) -> bool:
        """Whether ``hit`` is promoted before it is answered: some of it is on disk or in Redis, one KV
        cache group, and this request had no promotion yet."""
        if (
            not self._enabled
            or hit.in_cpu
            or rid in self._done
            or rid in self._running
            or len(hit.ranges) != 1
        ):
            return False
        return any(hit.where.get(t, 0) > 0 for t in PROMOTED_TIERS)

    def start(self, rid: str, hit: Hit, keys: list[list[bytes]], promote: Any) -> None:
        """Start promoting the hit's blocks: ``promote(keys, cold)`` starts it on the cache's loop and
        returns its future (CacheCalls.promote_later)."""
        parts, cold = load_parts(hit, keys, [[] for _ in hit.ranges])
        self._running[rid] = promote(parts[0][0], cold)
        self._counters["promotions"] += 1

    def forget(self, rid: str) -> None:
        """request_finished: its promotion is cancelled and nothing of the request is kept."""
        self._done.discard(rid)
        future = self._running.pop(rid, None)
        if future is not None and future.cancel():
            self._counters["cancelled_promotions"] += 1

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._running.values())

    def running(self) -> Sequence[str]:
        return list(self._running)
