"""The load side of the scheduler half: what this step's hits promised, the loads in flight, what each landed.

A hit whose blocks are all in the CPU tier is a synchronous load: its job is queued before vLLM's thread
goes on (CacheCalls.load_now: cross_process.step_jobs.start_sync_load) and rides in this step's metadata,
its promised blocks that no job loads are load errors in this same step. Any other hit is an asynchronous load that vLLM waits for
(WAITING_FOR_REMOTE_KVS) until a later step reports it. A load that came up short caps what a retry of
the request is promised (a load that keeps failing would otherwise be promised again forever).

A hybrid model's hit loads a range of blocks per KV cache group (hits.py) under one tag: one load per
group, always asynchronously (hits.py): vLLM 0.32 takes no block-level load errors from a model with
several KV cache groups, only whole requests in ``failed_recving``, and only for requests waiting for
their load (WAITING_FOR_REMOTE_KVS). So a hybrid load that landed short fails its request, which vLLM
recomputes.

A request may finish or be aborted while its load is in flight: its state is forgotten then, and what
the load brings later is only reported (an async load's finished_recving frees its blocks), never kept.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter
from dataclasses import dataclass

from ...scheduler.cache_calls import CacheCalls
from ...scheduler.hits import Hit
from ...scheduler.requests import new_tag
from ...scheduler.tails import hit_end, load_parts
from .meta import TieredKVMetadata

log = logging.getLogger(__name__)


@dataclass
class _Load:
    start: int  # first block of the request the load covers
    block_ids: list[list[int]]  # per group
    future: concurrent.futures.Future  # blocks landed: an int (one group) or one per group
    sync: bool  # served in the step it was planned: vLLM waits for no finished_recving
    boundary: int  # blocks computed once it all landed
    tail: bool = False  # its last block is a partial tail (tails.py): stored under its full key once computed
    tail_tokens: int = 0  # a partial tail's tokens it loads (tails.py), counted as a tail hit once landed


@dataclass
class _Asked:
    first: int  # the blocks vLLM computed itself
    hit: Hit


class LoadBook:
    def __init__(self, unit: int, calls: CacheCalls, counters: Counter[str], *, ratios: tuple[int, ...] = (1,),
                 hybrid: bool = False) -> None:  # fmt: skip
        self._unit = unit  # tokens per hit unit (groups.py): starts, boundaries and caps count units
        self._ratios = ratios  # each group's blocks per unit
        self._hybrid = hybrid  # vLLM has several KV cache groups: failures go by request, never by block
        self._calls = calls
        self._counters = counters
        self._asked: dict[str, _Asked] = {}
        self._loads: dict[str, _Load] = {}
        self._sync_tags: set[str] = set()  # this step's synchronous loads: the workers wait for their jobs
        self._sync_errors: list[int] = []  # this step's promised blocks no job loads: vLLM recomputes them
        self._cap: dict[str, int] = {}  # req -> blocks a load of it landed before a failure
        self._loaded_upto: dict[str, int] = {}  # blocks resident after a load (its stores start there)
        self._sources: dict[str, Counter[str]] = {}  # req -> the promised blocks per tier (vLLM's hit metrics)
        self._gone: set[str] = set()  # finished requests whose load is still in flight: keep nothing it brings

    def in_flight(self, rid: str) -> bool:
        return rid in self._loads

    def async_in_flight(self, rid: str) -> bool:
        """vLLM holds the blocks of a request waiting for its async load until finished_recving."""
        load = self._loads.get(rid)
        return load is not None and not load.sync

    @property
    def busy(self) -> bool:
        return bool(self._loads)

    def cap(self, rid: str, max_blocks: int) -> int:
        return min(max_blocks, self._cap.get(rid, max_blocks))

    def promised(self, rid: str, first: int, hit: Hit) -> None:
        """A hit was answered: its blocks past ``first``, all in the CPU tier (synchronous) or not."""
        self._asked[rid] = _Asked(first, hit)
        self._sources[rid] = hit.where

    def start(self, rid: str, keys: list[list[bytes]], block_ids: list[list[int]], num_external: int) -> None:
        """update_state_after_alloc: start the load of what this step's answer promised.

        ``keys`` and ``block_ids`` per group (block ids in vLLM's table of that group)."""
        asked = self._asked.pop(rid, None)
        if num_external <= 0 or asked is None:
            return
        start, hit = asked.first, asked.hit
        if start * self._unit + num_external != hit_end(hit, self._unit):  # it may end inside a block (tails.py)
            self._admitted_otherwise(rid, start, hit, block_ids, num_external)
            return
        ids = [block_ids[p][a:b] for p, (a, b) in enumerate(hit.ranges)]
        one = len(hit.ranges) == 1
        parts, cold = load_parts(hit, keys, ids)
        if not one:  # a group with nothing to load (all of its range computed by vLLM) landed nothing
            ids = [g for g, (a, b) in zip(ids, hit.ranges, strict=True) if b > a]
        flat = [b for group in ids for b in group]
        tag = new_tag(f"{rid}:load")
        tail_tokens = hit.tokens - (hit.boundary - 1) * self._unit if hit.tail is not None else 0
        if not hit.in_cpu:
            future = self._calls.load_later(tag, parts, grouped=not one, cold=cold)
            self._loads[rid] = _Load(start, ids, future, False, hit.boundary, hit.tail is not None, tail_tokens)
            return
        try:  # one group may load a leading part; several load all or nothing (each group's range is needed)
            future, planned = self._calls.load_now(tag, parts, len(flat), grouped=not one, cold=cold)
        except Exception as exc:
            log.warning("tiered_kv: a synchronous load for %s could not start: %r", rid, exc)
            future, planned = None, 0
        self._sync_errors += flat[planned:]
        self._counters["sync_loads"] += 1
        self._counters["load_error_blocks"] += len(flat) - planned
        upto = start + planned // self._ratios[0] if one else (hit.boundary if planned else start)
        if upto < hit.boundary:
            self._cap[rid] = upto
        self._loaded_upto[rid] = min(upto, hit.boundary - (hit.tail is not None))
        if future is not None:
            self._sync_tags.add(tag)
            tail_tokens = tail_tokens if planned == len(flat) else 0  # its last block is the tail's
            self._loads[rid] = _Load(start, [flat[:planned]] if one else ids, future, True, upto, False, tail_tokens)

    def _admitted_otherwise(self, rid: str, start: int, hit: Hit, block_ids: list[list[int]], num_external: int) -> None:
        """vLLM admitted another number of external tokens than promised: nothing is loaded, and the
        admitted blocks are reported failed (never left for a forward to read uninitialised)."""
        log.error("tiered_kv: %s: vLLM admitted %d external tokens, not the %d promised; reported as a failed "
                  "load (vLLM recomputes them)", rid, num_external, hit_end(hit, self._unit) - start * self._unit)  # fmt: skip
        end = start + -(-num_external // self._unit)
        ids = [group[start * r : end * r] for group, r in zip(block_ids, self._ratios, strict=True)]
        self._counters["load_admission_mismatches"] += 1
        self._cap[rid] = start
        if hit.in_cpu and not self._hybrid:  # answered synchronously: an error in this very step
            self._sync_errors += ids[0]
            self._counters["load_error_blocks"] += len(ids[0])
            return
        failed: concurrent.futures.Future = concurrent.futures.Future()
        failed.set_result([0] * len(ids) if len(ids) > 1 else 0)  # landed nothing: finish() reports it
        self._loads[rid] = _Load(start, ids, failed, False, end)

    def finish(self, meta: TieredKVMetadata) -> None:
        """Loads that returned since the last step: counted; an async one's outcome goes to the workers."""
        for rid, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[rid]
            gone = rid in self._gone
            self._gone.discard(rid)
            wanted = sum(len(ids) for ids in load.block_ids)
            try:
                got = load.future.result()
                landed = [int(got)] if isinstance(got, int) else [int(n) for n in got]
            except BaseException as exc:  # vLLM recomputes what we did not land
                log.warning("tiered_kv: load of %d blocks for %s failed: %r", wanted, rid, exc)
                landed = [0] * len(load.block_ids)
            self._counters["loaded_blocks"] += sum(landed)
            self._count_tail_hit(load, landed, gone)
            short = [ids[n:] for ids, n in zip(load.block_ids, landed, strict=True)]
            # One group: the blocks landed are a prefix of it. Several: a group short of its range
            # leaves the hit unusable past ``start`` (vLLM recomputes from its first missing block).
            upto = (load.start + landed[0] // self._ratios[0] if len(landed) == 1
                    else (load.start if any(short) else load.boundary))  # fmt: skip
            if upto < load.boundary and not gone:
                self._cap[rid] = upto  # a retry recomputes instead of being promised them again
            if load.sync:
                continue  # the workers reported their own copy failures in the step it ran
            self._counters["load_error_blocks"] += sum(map(len, short))
            if self._hybrid and any(short):  # vLLM takes no block ids from a hybrid model: fail the request
                meta.loads_done[rid] = []
                meta.loads_failed.append(rid)
                self._counters["failed_load_requests"] += 1
            else:
                meta.loads_done[rid] = [b for ids in short for b in ids]
            if not gone:
                self._loaded_upto[rid] = min(upto, load.boundary - load.tail)

    def _count_tail_hit(self, load: _Load, landed: list[int], gone: bool) -> None:
        """``tail_hits`` / ``tail_hit_tokens``: a partial tail served, once per load that landed it (its
        last block), never per lookup (vLLM asks again for a request that waits). A synchronous load served
        its step's forward even when its request finished since; an async one's request must still be there."""
        if not load.tail_tokens or landed[0] < len(load.block_ids[0]) or (gone and not load.sync):
            return
        self._counters["tail_hits"] += 1
        self._counters["tail_hit_tokens"] += load.tail_tokens

    def close_step(self, meta: TieredKVMetadata) -> None:
        """The step's jobs are in ``meta``: mark its synchronous loads and errors, forget its answers."""
        meta.sync_loads = [j.job_id for j in meta.load_jobs if j.req_id in self._sync_tags]
        self._counters["sync_load_jobs_sent"] += len(meta.sync_loads)
        meta.sync_load_errors, self._sync_errors = self._sync_errors, []
        self._sync_tags.clear()
        self._asked.clear()

    def loaded_upto(self, rid: str) -> int:
        return self._loaded_upto.pop(rid, 0)

    def hit_sources(self, rid: str, num_external: int) -> dict[str, int]:
        """The promised tokens per tier ("cpu", "disk", "remote", "" for blocks still being stored)."""
        where = self._sources.pop(rid, None)
        if not where or num_external <= 0:
            return {}
        out = {tier: n * self._unit for tier, n in where.items() if n > 0}
        extra = num_external - sum(out.values())  # vLLM wants them to sum to what it admitted
        if extra:
            top = max(out, key=out.get) if out else ""
            out[top] = out.get(top, 0) + extra
        return {k: v for k, v in out.items() if v > 0}

    def forget(self, rid: str) -> None:
        """request_finished: drop the request's state; a load still in flight is reported, never kept."""
        for table in (self._asked, self._loaded_upto, self._cap, self._sources):
            table.pop(rid, None)
        if rid in self._loads:
            self._gone.add(rid)

