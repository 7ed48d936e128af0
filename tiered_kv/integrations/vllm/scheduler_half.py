"""The connector's scheduler half: vLLM's requests and steps over the cache's whole state.

The cache (cross_process.SchedulerCache: manager, disk, remote; its CPU tier is the shared segment) is
reached through cache_calls.CacheCalls: each hook holds the cache's state lock and calls it directly in
vLLM's thread (the loop thread keeps only I/O); its GPU<->CPU copies are queued by the proxy engine as
jobs that ``build_meta`` hands to the workers. Each step keeps vLLM's protocol
(README, "Use with vLLM", the step protocol):

- a hit whose blocks are all in the CPU tier is served in the step it is found: ``matched_tokens``
  answers it as a synchronous load, ``after_alloc`` plans it and queues its job in vLLM's thread
  (cache_sync.load_sync), and the workers copy it before this step's forward;
- any other hit (disk, Redis, blocks another request is still storing) is an asynchronous load: the
  request waits (WAITING_FOR_REMOTE_KVS) until every rank landed it;
- stores are planned for the blocks this step's forward computes and issued by the workers in
  ``wait_for_save``, after the forward (target and draft) wrote them;
- a preempted request's unsent stores are cancelled and the sent ones fenced before its blocks are
  reused; its later stores carry a new tag.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from ...cross_process import STORE
from ...errors import ConfigError
from ...layout import KVLayout
from ...scheduler.cache_calls import CacheCalls, Store, close_before_executors_exit
from ...scheduler.groups import KVGroups
from ...scheduler.hints import NO_HINTS, RequestHints, hints_of
from ...scheduler.request_keys import group_block_keys, request_block_keys, salt_of, uses_prompt_embeds
from ...scheduler.requests import KeyCache, Req, new_tag, vllm_cache_is_empty
from ...scheduler.tails import Tails
from .block_bytes import check_rank_bytes, group_bytes_per_block, scheduler_bytes_per_block
from .events import HashBook, to_vllm_events
from .extra_config import resolve_config
from .loads import LoadBook
from .meta import TieredKVHandshake, TieredKVMetadata
from .promotions import Promotions
from .replicas import check_rank_replicas, kv_tp_replicas
from .stats import StatsFile
from .stores import StoreBook

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def _hook(name: str) -> Callable[[F], F]:
    """A vLLM hook: run under the cache's state lock (CacheCalls.locked: the cache is called directly in
    vLLM's thread), timed into ``hook_us_<name>`` / ``hook_calls_<name>`` (the connector's time per step)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: SchedulerHalf, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                with self._calls.locked(name):
                    return fn(self, *args, **kwargs)
            finally:
                self.counters[f"hook_us_{name}"] += int((time.perf_counter() - t0) * 1e6)
                self.counters[f"hook_calls_{name}"] += 1

        return run  # type: ignore[return-value]

    return wrap


class SchedulerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any], engine_id: str) -> None:
        self._bs: int = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self._world: int = int(pc.tensor_parallel_size)
        if int(getattr(pc, "pipeline_parallel_size", 1)) != 1:
            raise ConfigError("TieredKVConnector does not support pipeline parallel (pipeline_parallel_size > 1)")
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if int(getattr(pc, name, 1) or 1) != 1:
                raise ConfigError(f"TieredKVConnector does not support context parallelism ({name} = "
                                  f"{getattr(pc, name)}): a rank then holds part of each block's tokens")  # fmt: skip
        self._rank_bytes = scheduler_bytes_per_block(kv_cache_config)
        self._replicas = kv_tp_replicas(vllm_config, kv_cache_config, self._world)  # MLA: one copy per TP group
        self._stored_ranks = self._world // self._replicas  # TP ranks' shards a block stores (it divides)
        self._groups = KVGroups.from_config(kv_cache_config, str(getattr(vllm_config.cache_config,
                                                                         "mamba_cache_mode", "none")))  # fmt: skip
        self._group_bytes = {g.index: group_bytes_per_block(kv_cache_config, g.layers) or self._rank_bytes
                             for g in self._groups.groups}  # fmt: skip
        self._unit = self._groups.unit_tokens(self._bs)  # tokens a hit is a multiple of (groups.py)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._vllm_config = vllm_config
        events = getattr(vllm_config, "kv_events_config", None)
        self._events_on = bool(events is not None and getattr(events, "enable_kv_cache_events", False))
        self._extra = extra
        self._engine_id = engine_id
        self.counters: Counter[str] = Counter()
        self._calls = CacheCalls(self.counters)  # the cache, opened once the workers' handshake arrived
        self._store_book = StoreBook(self._groups, self._unit, self.counters)
        self._stats_file = StatsFile(extra.get("stats_file"))
        self._reqs: dict[str, Req] = {}
        self._salts: dict[str, tuple[int, ...]] = {}
        self._no_store: set[str] = set()  # requests whose KV no key can name (prompt embeddings)
        self._keys = KeyCache(self._compute_keys)
        self._hints: dict[str, RequestHints] = {}
        self._loads = LoadBook(self._unit, self._calls, self.counters, hybrid=self._groups.hybrid,
                               ratios=tuple(g.blocks(1, self._unit) for g in self._groups.groups))  # fmt: skip
        self._promotions = Promotions(self.counters, enabled=bool(extra.get("promote_hits", True)))
        self._tails = Tails(self._groups, self._unit, kv_cache_config)  # hits inside a block
        self._vllm_hashes: dict[str, Any] = {}  # req -> request.block_hashes (vLLM's live list)
        self._book = HashBook(cap=1 << 20)  # our key -> vLLM hash, for the router's KV events
        self._vllm_cache: Any = None  # vLLM's KVCacheManager (bind_kv_cache_manager), for reset
        self._closed = False
        self._exit_hook = close_before_executors_exit(self.close)  # cancelled by close: the half can go

    # -- start: the workers' handshake carries each rank's layout -----------------------------
    def on_handshake(self, metas: dict[int, Any]) -> None:
        ranks = {int(r): m for r, m in metas.items() if isinstance(m, TieredKVHandshake)}
        if sorted(ranks) != list(range(self._world)):
            raise ConfigError(f"tiered_kv: expected a handshake from TP ranks 0..{self._world - 1}, got {sorted(ranks)}")
        for rank, m in ranks.items():
            check_rank_bytes(m.bytes_per_block, self._rank_bytes, rank=rank)
        check_rank_replicas(ranks, self._replicas)
        shard_layout = KVLayout.from_spec(ranks[0].layout_spec)
        mc = self._vllm_config.model_config
        cfg = resolve_config(self._extra["config"], str(mc.model), getattr(mc, "revision", None),
                             self._rank_bytes * self._stored_ranks)  # fmt: skip
        opened = self._calls.open(cfg, shard_layout, world_size=self._world, engine_id=self._engine_id,
                                  kv_replicas=self._replicas)  # fmt: skip
        # Every rank attached the segment before its handshake got here: its name can go (issue 25 item 8).
        opened.segment_mapped_by_all()
        log.info("tiered_kv: scheduler cache over %s, %d ranks x %d bytes per block, %s", opened.segment_info.path,
                 self._world, self._rank_bytes, self._calls.stats()["cpu"])  # fmt: skip
        if self._stored_ranks != self._world:
            log.info("tiered_kv: %d consecutive TP ranks hold the same KV (kv_tp_replicas): %d copy(ies) per "
                     "block in every tier, written by the first rank of each", self._replicas, self._stored_ranks)  # fmt: skip
        if self._groups.hybrid:
            log.info("tiered_kv: %d KV cache groups, stored per (block, group): %s", self._groups.num_groups,
                     self._groups.describe())  # fmt: skip

    # -- residency ------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        rid = request.request_id
        self._salts[rid] = salt_of(request)
        self._vllm_hashes[rid] = getattr(request, "block_hashes", None)
        if uses_prompt_embeds(request):  # its positions carry placeholder token ids: no key names its KV
            self._no_store.add(rid)
            self.counters["prompt_embeds_requests"] += 1
        hints = hints_of(request, self.counters)
        if hints is not NO_HINTS:
            self._hints[rid] = hints

    def _compute_keys(self, rid: str, prompt: list[int]) -> list[list[bytes]]:
        keyer, salt = self._calls.opened.keyer, self._salts.get(rid, ())
        base: dict[int, list[bytes]] = {}  # block size -> the prompt's block keys at that size
        for g in self._groups.groups:
            bs = g.tokens_per_block(self._unit)
            if bs not in base:
                base[bs] = request_block_keys(keyer, prompt, bs, salt)
        return [group_block_keys(keyer, base[g.tokens_per_block(self._unit)], g.salt) for g in self._groups.groups]

    def loaded_group_ids(self) -> tuple[int, ...]:
        """vLLM's get_loaded_kv_cache_group_ids: a hit restores every group tiered_kv stores."""
        return self._groups.ids

    @_hook("matched_tokens")
    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if self._loads.in_flight(rid) or self._promotions.waiting(rid):
            return None, False  # a load or promotion of this request is still in flight: ask again later
        if rid in self._no_store:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        limit = self._loads.cap(rid, len(prompt) // self._unit + 1)  # units a hit may fill, a tail's too
        max_blocks, reach = self._tails.bounds(len(prompt), limit)  # vLLM computes the last prompt token
        if reach <= num_computed:
            return 0, False
        keys = self._keys.get(rid, prompt)
        first = num_computed // self._unit
        hints = self._hints.get(rid, NO_HINTS)
        # Whole blocks (hits.py), then maybe a partial tail (tails.py), on the cache's loop.
        hit = self._calls.find_hit(rid, lambda c: self._tails.find(c, keys, prompt, first, max_blocks, limit, hints))
        n = 0 if hit is None else hit.tokens - num_computed  # it may end inside a block (tails.py)
        if n <= 0:
            return 0, False
        if self._promotions.wanted(rid, hit):  # disk/Redis blocks: into CPU slots first (promotions.py)
            self._promotions.start(rid, hit, keys, self._calls.promote_later)
            return None, False
        self._loads.promised(rid, first, hit)
        # A CPU hit loads in this step (synchronously), when its copy can start at once (the byte budget
        # is freed by reports only later steps bring); anything else asynchronously.
        return n, not hit.in_cpu

    @_hook("after_alloc")
    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        keys = self._keys.get(request.request_id, list(request.prompt_token_ids or []))
        ids = blocks.get_block_ids()
        self._loads.start(request.request_id, keys, [list(ids[g.index]) for g in self._groups.groups], num_external)

    # -- each step ------------------------------------------------------------------------------
    @_hook("build_meta")
    def build_meta(self, so: Any) -> TieredKVMetadata:
        meta = TieredKVMetadata()
        if not self._calls.is_open:
            return meta
        for rid in so.preempted_req_ids or ():
            req = self._reqs.get(rid)
            in_flight = req is not None and bool(req.pending_stores())
            meta.fence += self._fence(rid)
            self.counters["preemptions"] += 1
            self.counters["fenced_preemptions"] += in_flight  # its stores were cancelled or fenced
        self._loads.finish(meta)
        proxy = self._calls.proxy
        meta.fence += self._store_book.fence_windows(proxy)
        stores: list[tuple[Req, Any]] = []
        for new in so.scheduled_new_reqs:
            req = self._admit(new)
            stores.append((req, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)))
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            req = self._reqs.get(rid)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                for p, g in enumerate(self._groups.groups):
                    got = list(new_ids[g.index])
                    req.block_ids[p] = got if rid in resumed else req.block_ids[p] + got
            stores.append((req, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)))
        self._queue_stores([(r, self._rid_of(r), done) for r, done in stores])
        self._store_book.release_held(meta)
        for job in proxy.take_jobs():
            (meta.store_jobs if job.direction == STORE else meta.load_jobs).append(job)
        self._loads.close_step(meta)
        self._maybe_write_stats()
        return meta

    def _rid_of(self, req: Req) -> str:
        return req.tag.rsplit("#", 1)[0]

    def _admit(self, new: Any) -> Req:
        """A request scheduled as new: first seen, or an id coming back (a streaming session's next chunk,
        a preempted request resumed as new): its state and its stores in flight carry over."""
        rid = new.req_id
        prompt = list(new.prompt_token_ids or [])
        groups = self._groups.groups
        keys = [[] for _ in groups] if rid in self._no_store else self._keys.get(rid, prompt)
        ids = [list(new.block_ids[g.index]) for g in groups]
        req = self._reqs.get(rid)
        if req is None:
            req = self._reqs[rid] = Req(prompt, keys, ids, new_tag(rid), next_store=[0] * len(groups))
        else:
            req.prompt, req.keys, req.block_ids = prompt, keys, ids
            self.counters["readmitted_requests"] += 1
        upto = self._loads.loaded_upto(rid)
        req.store_from([g.blocks(upto, self._unit) for g in groups])
        return req

    def _fence(self, rid: str) -> list[int]:
        req = self._reqs.get(rid)
        return [] if req is None else self._store_book.fence(self._calls.proxy, req, rid)

    def _queue_stores(self, todo: list[tuple[Req, str, int]]) -> None:
        """Plan stores of the prompt blocks each request's forward computes in this step; their jobs
        ride in this step's metadata and the workers issue them in wait_for_save, after the forward."""
        batch: list[tuple[Req, Store]] = []
        for req, rid, done_tokens in todo:
            if rid in self._no_store:
                continue
            hints = self._hints.get(rid, NO_HINTS)
            for st in self._store_book.plan(req, rid, done_tokens):
                hashes = self._vllm_hashes.get(rid)
                # vLLM's hashes are per block of its one block size; with several sizes no index maps them.
                if st.full and hashes is not None and not self._groups.unit and len(hashes) >= st.first + len(st.keys):
                    self._book.remember(st.keys, hashes[st.first : st.first + len(st.keys)])
                batch.append((req, (st.tag, st.keys, st.block_ids, st.prefix, hints, False)))
            batch += self._tails.stores(self._calls.opened.keyer, req, done_tokens)  # a partial last prompt block
        if not batch:
            return
        try:
            futures = self._calls.start_stores([store for _, store in batch])
        except Exception as exc:  # a lost store is a future miss, never an engine failure
            log.warning("tiered_kv: stores could not start: %r", exc)
            return
        for (req, _), future in zip(batch, futures, strict=True):
            future.add_done_callback(_log_store_failure)
            req.pending_stores().append(future)

    @_hook("update_output")
    def update_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not self._calls.is_open or meta is None:
            return
        for rank, (ok, failed) in getattr(meta, "reports", {}).items():
            self._calls.proxy.report(rank, ok, failed)

    def has_pending_block_frees(self) -> bool:
        """Finished requests whose blocks wait for their stores: vLLM waits for them instead of preempting."""
        return self._store_book.holding

    def hit_sources(self, rid: str, num_external: int) -> dict[str, int]:
        return self._loads.hit_sources(rid, num_external)

    def has_jobs_in_flight(self) -> bool:
        return self._calls.is_open and self._calls.proxy.inflight > 0

    @_hook("request_finished")
    def request_finished(self, request: Any) -> bool:
        """True: vLLM keeps the request's blocks until a later step reports its stores resolved (a
        synchronous load has landed before its step's forward; window stores are fenced next step, as
        vLLM freed those blocks already). False while an async load is in flight: vLLM holds the blocks
        itself until our finished_recving, which frees them (a True would free them twice)."""
        rid = request.request_id
        for table in (self._salts, self._vllm_hashes):
            table.pop(rid, None)
        waits_for_load = self._loads.async_in_flight(rid)
        self._loads.forget(rid)
        self._promotions.forget(rid)
        self._keys.pop(rid)
        self._no_store.discard(rid)
        req = self._reqs.pop(rid, None)
        stores = req.pending_stores() if req is not None else []
        hints = self._hints.pop(rid, NO_HINTS)
        if hints.end_session and self._calls.is_open:
            # After the request's own stores resolved, its chain is the first to evict. The release may
            # come after the engine's last step, and vLLM may kill the EngineCore before close: the
            # counters are written then, off the loop (the report reads stats on it).
            self._calls.release_after(hints.session, list(stores), self._maybe_write_stats)
        if waits_for_load or not stores:
            return False
        return self._store_book.hold(rid, stores)

    @_hook("reset")
    def reset(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), e.g. after a weight update: every tier forgets
        every block (disk records invalidated for good, the Redis namespace emptied). False, changing
        nothing, while a load or store is in flight (vLLM reports the reset as failed; try again)."""
        if not self._calls.is_open:
            return True
        if self._vllm_cache is not None and not vllm_cache_is_empty(self._vllm_cache):
            return False  # vLLM's own reset failed (blocks in use): reset only what vLLM reset
        busy = self._loads.busy or self._store_book.holding or any(r.pending_stores() for r in self._reqs.values())
        if busy or self._calls.proxy.inflight:
            return False
        ok = self._calls.reset()
        if ok:
            self.counters["resets"] += 1
            self._maybe_write_stats()
        return ok

    def bind_vllm_cache(self, kv_cache_manager: Any) -> None:
        self._vllm_cache = kv_cache_manager

    @_hook("take_events")
    def take_events(self) -> list[Any]:
        """The tiers' stored/removed blocks since the last call, as vLLM KV events in vLLM's block hashes."""
        if not self._calls.is_open or not self._events_on:
            return []  # vLLM asks every step; with KV events off there is nothing to wait on the loop for
        records = self._book.translate(self._calls.take_events())
        for stored, medium, hashes in records:  # counted, so stats_file shows what a router was told
            self.counters[f"event_{'stored' if stored else 'removed'}_{medium.lower()}_blocks"] += len(hashes)
        events = to_vllm_events(records, self._bs)
        return events

    # -- stats and shutdown ---------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        groups = [{"group": g.index, "kind": g.kind, "window": g.window, "bytes_per_block": self._group_bytes[g.index],
                   "block_size": g.tokens_per_block(self._unit)} for g in self._groups.groups]  # fmt: skip
        return {"counters": dict(self.counters), "stats": self._calls.stats(), "groups": groups,
                "kv_cache_groups": self._groups.num_groups, "stored_ranks": self._stored_ranks,
                "state": self._calls.state}  # fmt: skip

    def _maybe_write_stats(self, force: bool = False) -> None:
        if self._calls.is_open and (force or not self._closed):
            self._stats_file.write(self.counters, self.report, force)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._exit_hook.cancel()  # the hook no longer keeps this half (and its cache's state) alive
        self._maybe_write_stats(force=True)  # before closing: vLLM may kill the process meanwhile
        opened = self._calls.is_open
        self._calls.close("the engine is shutting down")
        if opened:  # again, saying "state": "closed" (the stats are the last ones the cache had)
            self._stats_file.write(self.counters, self.report, force=True)


def _log_store_failure(future: concurrent.futures.Future) -> None:
    """A lost store is a future miss, never an engine failure; a fenced one is expected."""
    if future.cancelled() or future.exception() is None:
        return
    log.debug("tiered_kv: a store was dropped: %r", future.exception())
