"""The connector's scheduler half: the cache's whole state, its residency answer, the per-step jobs.

The TieredKVCache (manager, disk, remote) runs on a loop thread owned here; its
CPU tier is the shared segment and its GPU<->CPU copies are queued by the proxy
engine as jobs that ``build_meta`` hands to the workers. vLLM's thread never
waits for a store or a load: it starts them on the loop and picks up their
results at a later step. See README, "Use with vLLM", for the step-by-step flow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...layout import KVLayout
from ...split.proxy import request_scope
from ...split.scheduler import open_scheduler_cache
from .events import HashBook, to_vllm_events
from .geometry import check_rank_bytes, scheduler_bytes_per_block
from .hints import NO_HINTS, RequestHints, hints_of
from .keys import request_block_keys, salt_of
from .meta import TieredKVHandshake, TieredKVMetadata
from .runtime import (
    LoopThread,
    close_before_executors_exit,
    publish_runtime,
    resolve_config,
    unpublish_runtime,
)

log = logging.getLogger(__name__)


@dataclass
class _Req:
    prompt: list[int]
    salt: tuple[int, ...]
    keys: list[bytes]  # of every full prompt block
    block_ids: list[int] = field(default_factory=list)
    next_store: int = 0  # first block not yet stored or known resident
    gen: int = 0  # bumped at each preemption: the tag of its jobs is f"{req_id}#{gen}"
    stores: list[concurrent.futures.Future] = field(default_factory=list)  # of the current generation

    def tag(self, rid: str) -> str:
        return f"{rid}#{self.gen}"


@dataclass
class _Load:
    start: int
    block_ids: list[int]
    future: concurrent.futures.Future


class SchedulerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any], engine_id: str) -> None:
        self._bs: int = vllm_config.cache_config.block_size
        self._world: int = int(vllm_config.parallel_config.tensor_parallel_size)
        if int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("TieredKVConnector does not support pipeline parallel (pipeline_parallel_size > 1)")
        self._rank_bytes = scheduler_bytes_per_block(kv_cache_config)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._vllm_config = vllm_config
        self._extra = extra
        self._engine_id = engine_id
        self._loop = LoopThread("tiered-kv-scheduler")
        self._side: Any = None  # split.scheduler.SchedulerSide, once the workers' handshake arrived
        self.counters: Counter[str] = Counter()
        self._written: Counter[str] | None = None  # the counters stats_file last showed
        self._stats_lock = threading.Lock()
        self._reqs: dict[str, _Req] = {}
        self._salts: dict[str, tuple[int, ...]] = {}
        self._prompt_keys: dict[str, list[bytes]] = {}
        self._hints: dict[str, RequestHints] = {}
        self._asked: dict[str, int] = {}  # req -> first block a hit answered this step would load
        self._loads: dict[str, _Load] = {}
        self._loaded_upto: dict[str, int] = {}  # blocks resident after a finished load (next_store starts there)
        self._held: dict[str, list[concurrent.futures.Future]] = {}  # finished, blocks kept until stores resolve
        self._vllm_hashes: dict[str, Any] = {}  # req -> request.block_hashes (vLLM's live list)
        self._book = HashBook(cap=1 << 20)  # our key -> vLLM hash, for the router's KV events
        self._closed = False
        publish_runtime(engine_id, self)
        close_before_executors_exit(self.close)

    # -- start: the workers' handshake carries each rank's layout -----------------------------
    def on_handshake(self, metas: dict[int, Any]) -> None:
        ranks = {int(r): m for r, m in metas.items() if isinstance(m, TieredKVHandshake)}
        if sorted(ranks) != list(range(self._world)):
            raise ConfigError(f"tiered_kv: expected a handshake from TP ranks 0..{self._world - 1}, got {sorted(ranks)}")
        for rank, m in ranks.items():
            check_rank_bytes(m.bytes_per_block, self._rank_bytes, rank=rank)
        shard_layout = KVLayout.from_spec(ranks[0].layout_spec)
        mc = self._vllm_config.model_config
        cfg = resolve_config(self._extra["config"], str(mc.model), getattr(mc, "revision", None),
                             self._rank_bytes * self._world)  # fmt: skip
        self._side = self._loop.call(open_scheduler_cache(cfg, shard_layout, world_size=self._world,
                                                          engine_id=self._engine_id))  # fmt: skip
        # Every rank attached the segment before its handshake got here: its name can go (issue 25 item 8).
        self._side.segment_mapped_by_all()
        log.info("tiered_kv: scheduler cache over %s, %d ranks x %d bytes per block, %s", self._side.segment_info.path,
                 self._world, self._rank_bytes, self._stats()["cpu"])  # fmt: skip

    def _ready(self) -> Any:
        if self._side is None:
            raise ConfigError("tiered_kv: no handshake from the workers reached the scheduler (unsupported executor?)")
        return self._side

    # -- residency ------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._salts[request.request_id] = salt_of(request)
        self._vllm_hashes[request.request_id] = getattr(request, "block_hashes", None)
        hints = hints_of(request)
        if hints is not NO_HINTS:
            self._hints[request.request_id] = hints

    def _keys(self, rid: str, prompt: list[int]) -> list[bytes]:
        """Keys of every full prompt block, computed once per request."""
        keys = self._prompt_keys.get(rid)
        if keys is None:
            keys = self._prompt_keys[rid] = request_block_keys(self._ready().keyer, prompt, self._bs,
                                                               self._salts.get(rid, ()))  # fmt: skip
        return keys

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid in self._loads:
            return None, False  # a load of this request is still in flight: ask again later
        prompt = list(request.prompt_token_ids or [])
        max_blocks = (len(prompt) - 1) // self._bs  # vLLM computes at least the last prompt token
        if max_blocks * self._bs <= num_computed:
            return 0, False
        side = self._ready()
        keys = self._keys(rid, prompt)[:max_blocks]
        hints = self._hints.get(rid, NO_HINTS)

        async def run() -> int:
            # Blocks whose store is in flight count: the load waits for them (and comes up short if one fails).
            hit = side.cache.lookup(keys).total
            if hit:  # the promised blocks are the last to go
                side.cache.touch(keys[:hit], session=hints.session, expect_followup=hints.expect_followup)
            return hit

        try:
            hit = self._loop.call(run())
        except Exception as exc:
            log.warning("tiered_kv: lookup for %s failed, treating it as a miss: %r", rid, exc)
            return 0, False
        n = hit * self._bs - num_computed
        if n <= 0:
            return 0, False
        self._asked[rid] = num_computed // self._bs
        return n, True

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        if num_external <= 0 or rid not in self._asked:
            return
        start = self._asked.pop(rid)
        end = start + num_external // self._bs
        ids = list(blocks.get_block_ids()[0])[start:end]
        keys = self._keys(rid, list(request.prompt_token_ids or []))[start:end]
        side = self._ready()

        async def load() -> int:
            with request_scope(f"{rid}#load"):
                return await side.cache.load(keys, ids)

        self._loads[rid] = _Load(start, ids, self._loop.submit(load()))

    # -- each step ------------------------------------------------------------------------------
    def build_meta(self, so: Any) -> TieredKVMetadata:
        meta = TieredKVMetadata()
        side = self._side
        if side is None:
            return meta
        for rid in so.preempted_req_ids or ():
            fenced = self._fence(rid)
            self.counters["preemptions"] += 1
            self.counters["fenced_preemptions"] += fenced
            meta.flush |= fenced
        self._finish_loads(meta)
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            prompt = list(new.prompt_token_ids or [])
            salt = self._salts.get(rid, ())
            req = _Req(prompt, salt, self._keys(rid, prompt), list(new.block_ids[0]))
            req.next_store = self._loaded_upto.pop(rid, 0)
            self._reqs[rid] = req
            self._queue_store(rid, req, new.num_computed_tokens + so.num_scheduled_tokens.get(rid, 0))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            req = self._reqs.get(rid)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                req.block_ids = list(new_ids[0]) if rid in resumed else req.block_ids + list(new_ids[0])
            self._queue_store(rid, req, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0))
        for rid, futures in list(self._held.items()):
            if all(f.done() for f in futures):
                del self._held[rid]
                meta.stores_done.append(rid)
        meta.jobs = side.proxy.take_jobs()
        self._asked.clear()
        self._maybe_write_stats()
        return meta

    def _fence(self, rid: str) -> bool:
        """A preempted request's blocks are free now: no store of them may reach a worker any more.

        Its unsent jobs (and any its pending stores submit later) fail at the proxy; True
        when some of its stores may already be copying, so the workers must flush first.
        """
        req = self._reqs.get(rid)
        if req is None:
            return False
        pending = any(not f.done() for f in req.stores)
        if pending:
            self._side.proxy.cancel_request(req.tag(rid))
        req.gen += 1
        req.stores = []
        return pending

    def _finish_loads(self, meta: TieredKVMetadata) -> None:
        for rid, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[rid]
            try:
                n = int(load.future.result())
            except Exception as exc:  # vLLM recomputes what we did not land
                log.warning("tiered_kv: load of %d blocks for %s failed: %r", len(load.block_ids), rid, exc)
                n = 0
            self.counters["loaded_blocks"] += n
            self.counters["load_error_blocks"] += len(load.block_ids) - n
            meta.loads_done[rid] = load.block_ids[n:]
            self._loaded_upto[rid] = load.start + n

    def _queue_store(self, rid: str, req: _Req, done_tokens: int) -> None:
        end = min(done_tokens, len(req.prompt), len(req.block_ids) * self._bs) // self._bs
        if end <= req.next_store:
            return
        start, req.next_store = req.next_store, end
        keys, prefix, ids = req.keys[start:end], req.keys[:start], req.block_ids[start:end]
        cache, tag = self._side.cache, req.tag(rid)
        hints = self._hints.get(rid, NO_HINTS)
        hashes = self._vllm_hashes.get(rid)
        if hashes is not None and len(hashes) >= end:
            self._book.remember(keys, hashes[start:end])

        async def store() -> None:
            with request_scope(tag):
                res = await cache.store(keys, ids, prefix=prefix, session=hints.session,
                                        expect_followup=hints.expect_followup)  # fmt: skip
            self.counters["stored_blocks"] += getattr(res, "stored", 0)

        future = self._loop.submit(store())
        future.add_done_callback(_log_store_failure)
        req.stores = [f for f in req.stores if not f.done()]
        req.stores.append(future)

    def update_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._side is None or meta is None:
            return
        for rank, (ok, failed) in getattr(meta, "reports", {}).items():
            self._side.proxy.report(rank, ok, failed)

    def request_finished(self, request: Any) -> bool:
        """True: vLLM keeps the request's blocks until a later step reports its stores resolved."""
        rid = request.request_id
        self._salts.pop(rid, None)
        self._vllm_hashes.pop(rid, None)
        self._prompt_keys.pop(rid, None)
        self._asked.pop(rid, None)
        self._loaded_upto.pop(rid, None)
        req = self._reqs.pop(rid, None)
        hints = self._hints.pop(rid, NO_HINTS)
        if hints.end_session and self._side is not None:
            self._release_session(hints.session, req.stores if req else [])
        if rid in self._loads:
            return False  # vLLM holds the blocks of a request waiting for its load (finished_recving frees them)
        pending = [f for f in (req.stores if req else ()) if not f.done()]
        if not pending:
            return False
        self._held[rid] = pending
        return True

    def _release_session(self, session: str | int, stores: list[concurrent.futures.Future]) -> None:
        """The session ended: after the request's own stores resolved, its chain is the first to evict."""
        cache = self._side.cache

        async def release() -> None:
            if stores:  # a failed store is no reason to keep the session
                await asyncio.wait([asyncio.wrap_future(f) for f in stores])
            self.counters["released_blocks"] += len(cache.release(session))
            # The release may come after the engine's last step, and vLLM may kill the EngineCore
            # before close: write the counters now, off the loop (the report reads stats on it).
            await asyncio.get_running_loop().run_in_executor(None, self._maybe_write_stats)

        self._loop.submit(release())

    def take_events(self) -> list[Any]:
        """The tiers' stored/removed blocks since the last call, as vLLM KV events in vLLM's block hashes."""
        if self._side is None:
            return []
        cache = self._side.cache

        async def run() -> list[tuple[str, str, list[bytes]]]:
            return cache.take_events()

        records = self._book.translate(self._loop.call(run()))
        for stored, medium, hashes in records:  # counted, so stats_file shows what a router was told
            self.counters[f"event_{'stored' if stored else 'removed'}_{medium.lower()}_blocks"] += len(hashes)
        events = to_vllm_events(records, self._bs)
        return events

    # -- stats and shutdown ---------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            return self._side.cache.stats()

        return self._loop.call(run()) if self._side is not None else {}

    def report(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "stats": self._stats()}

    def _maybe_write_stats(self, force: bool = False) -> None:
        """``stats_file``: rewritten whenever the counters moved (vLLM may kill the EngineCore at shutdown
        before the connector closes, so the file cannot wait for close)."""
        path = self._extra.get("stats_file")
        with self._stats_lock:  # the scheduler thread and a session release may both write
            if not path or self._side is None or (not force and (self._closed or self.counters == self._written)):
                return
            self._written = Counter(self.counters)
            try:
                tmp = Path(f"{path}.tmp")
                tmp.write_text(json.dumps(self.report(), default=str))
                tmp.replace(path)
            except Exception:  # a report is not worth failing a step for
                log.exception("tiered_kv: writing stats to %s failed", path)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        unpublish_runtime(self._engine_id, self)
        self._maybe_write_stats(force=True)
        try:
            if self._side is not None:
                self._loop.call(self._side.aclose())
        except Exception:  # closing must never take the engine down with it
            log.exception("tiered_kv: closing the scheduler cache failed")
        finally:
            self._loop.stop()


def _log_store_failure(future: concurrent.futures.Future) -> None:
    """A lost store is a future miss, never an engine failure; a fenced one is expected."""
    if future.cancelled() or future.exception() is None:
        return
    log.debug("tiered_kv: a store was dropped: %r", future.exception())
