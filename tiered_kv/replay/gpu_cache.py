"""The emulated engine's GPU prefix cache: an LRU over GPU block ids, with references and blocks in flight.

A block used by a running request is referenced and out of the LRU, so it is never
evicted. A request's new blocks are visible as soon as they are allocated (pending):
a concurrent request with the same prefix hits them and waits until their bytes are
valid, as a scheduler that shares a running prefill would. Eviction hands the victims
back to the caller (to store them below) unless their session was released.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence


class GpuPrefixCache:
    """LRU over GPU block ids keyed by block key; referenced blocks are never evicted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.cached: dict[bytes, int] = {}  # key -> gid, referenced or not
        self.gid_key: list[bytes | None] = [None] * num_blocks
        self.refs = [0] * num_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached gids, oldest first
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.dead: set[int] = set()  # cached gids of released sessions: evicted without a store
        # Gids allocated and published before their bytes are valid (a running request computes or
        # loads them); a concurrent request hits them and waits on the future before finishing.
        self.pending: dict[int, asyncio.Future[None]] = {}
        self.invalid: set[int] = set()  # pending gids whose request failed, still held by others

    def leading_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self.cached:
                break
            n += 1
        return n

    def try_acquire(self, keys: Sequence[bytes]) -> tuple[int, list[int], list[tuple[bytes, int]]] | None:
        """Pin the leading hits and allocate blocks for the rest, or change nothing (None).

        Also returns the cached blocks evicted for the allocation, oldest first, as
        (key, gid): their gids now belong to this request, their bytes are still intact.
        """
        hits = self.leading_hits(keys)
        hit_ids = [self.cached[k] for k in keys[:hits]]
        need = len(keys) - hits
        idle_hits = sum(1 for g in hit_ids if self.refs[g] == 0)
        if need > len(self.free) + len(self.lru) - idle_hits:
            return None
        for gid in hit_ids:
            self._ref(gid)
        evicted: list[tuple[bytes, int]] = []
        new_ids = [self._allocate(evicted) for _ in range(need)]
        loop = asyncio.get_running_loop()
        for key, gid in zip(keys[hits:], new_ids, strict=True):
            self.refs[gid] = 1
            if key not in self.cached:  # visible at once, as in flight
                self.cached[key] = gid
                self.gid_key[gid] = key
                self.pending[gid] = loop.create_future()
        return hits, hit_ids + new_ids, evicted

    async def ready(self, gids: Sequence[int]) -> None:
        """Wait until the blocks other requests are still computing or loading are valid."""
        if any(g in self.invalid for g in gids):
            raise RuntimeError("the request computing a block this one hit failed")
        waits = [self.pending[g] for g in gids if g in self.pending]
        if waits:
            await asyncio.gather(*(asyncio.shield(f) for f in waits))

    def _ref(self, gid: int) -> None:
        if self.refs[gid] == 0:
            del self.lru[gid]
            self.dead.discard(gid)  # reused after all
        self.refs[gid] += 1

    def _allocate(self, evicted: list[tuple[bytes, int]]) -> int:
        if self.free:
            return self.free.pop()
        gid, _ = self.lru.popitem(last=False)
        key = self.gid_key[gid]
        del self.cached[key]  # type: ignore[arg-type]
        self.gid_key[gid] = None
        if gid in self.dead:
            self.dead.discard(gid)
        else:
            evicted.append((key, gid))  # type: ignore[arg-type]
        return gid

    def publish(self, keys: Sequence[bytes], gids: Sequence[int]) -> None:
        """Make a running request's blocks visible as soon as their bytes are valid (still referenced).

        A concurrent request then hits them here instead of missing them everywhere: an
        exclusive load already made the cache's copies the first to go.
        """
        for key, gid in zip(keys, gids, strict=True):
            owner = self.cached.get(key)
            if owner is None:
                self.cached[key] = gid
                self.gid_key[gid] = key
            elif owner == gid and gid in self.pending:
                self.pending.pop(gid).set_result(None)

    def finish(self, keys: Sequence[bytes], gids: Sequence[int], publish: int) -> None:
        """Drop the request's references, last block first, publishing its first ``publish`` blocks."""
        for i in range(len(keys) - 1, -1, -1):
            key, gid = keys[i], gids[i]
            owner = self.cached.get(key)
            if owner == gid and gid in self.pending:  # never became valid: this request failed
                fut = self.pending.pop(gid)
                fut.set_exception(RuntimeError("the request computing this block failed"))
                fut.exception()  # retrieved: requests waiting on it fail with it
                del self.cached[key]
                self.gid_key[gid] = None
                self.invalid.add(gid)
                owner = None
            if gid in self.invalid:  # never valid: every holder gives it back, the last frees it
                self.refs[gid] -= 1
                if self.refs[gid] == 0:
                    self.invalid.discard(gid)
                    self.free.append(gid)
                continue
            if owner == gid:
                self.refs[gid] -= 1
                if self.refs[gid] == 0:
                    self.lru[gid] = None
            elif owner is not None or i >= publish:
                # A concurrent request published this key first (or it is not to be kept): give ours back.
                self.refs[gid] -= 1
                if self.refs[gid] == 0:
                    self.free.append(gid)
                if owner is not None and owner in self.lru:
                    self.lru.move_to_end(owner)
            else:
                self.cached[key] = gid
                self.gid_key[gid] = key
                self.refs[gid] = 0
                self.lru[gid] = None

    def release(self, keys: Sequence[bytes]) -> None:
        """Blocks of an ended session: first to be evicted, and not worth storing when they are."""
        for key in reversed(keys):
            gid = self.cached.get(key)
            if gid is not None:
                self.dead.add(gid)
                if gid in self.lru:
                    self.lru.move_to_end(gid, last=False)


