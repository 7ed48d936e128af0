"""Every call the scheduler half makes into the cross-process cache, from vLLM's thread.

The cache (``cross_process.SchedulerCache``: the TieredKVCache over the shared segment, and the proxy
engine whose jobs the workers copy) lives on an asyncio loop in a thread owned here
(``loops.LoopThread``); each call below hops onto it and, but for the ones that say otherwise, waits.
The scheduler half (scheduler_half.py) keeps vLLM's request and step state and reaches the cache only
through this class and the proxy it hands out (``proxy``: the jobs to send, the ranks' reports, fences).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from ...config import Config
from ...cross_process import (
    ProxyCopyEngine,
    SchedulerCache,
    gather_loads,
    open_scheduler_cache,
    run_tagged,
    start_stores,
    start_sync_load,
)
from ...errors import ConfigError
from ...layout import KVLayout
from ...loops import LoopThread
from .hints import RequestHints
from .hits import Hit

log = logging.getLogger(__name__)

# tag, keys, block ids, prefix, hints, cold (a partial tail: put at the cold end once stored, tails.py)
Store = tuple[str, list[bytes], list[int], list[bytes], RequestHints, bool]
Parts = list[tuple[list[bytes], list[int]]]  # a load's (keys, block ids), one per KV cache group


class CacheCalls:
    """The scheduler's cache on its loop thread (module docstring); ``counters`` is the half's."""

    def __init__(self, counters: Counter[str]) -> None:
        self._loop = LoopThread("tiered-kv-scheduler")
        self._counters = counters
        self._opened: SchedulerCache | None = None

    # -- start and stop ---------------------------------------------------------------------------
    def open(
        self, config: Config, shard_layout: KVLayout, *, world_size: int, engine_id: str, kv_replicas: int
    ) -> SchedulerCache:
        self._opened = self._loop.call(
            open_scheduler_cache(
                config, shard_layout, world_size=world_size, engine_id=engine_id, kv_replicas=kv_replicas
            )
        )
        return self._opened

    @property
    def is_open(self) -> bool:
        return self._opened is not None

    @property
    def opened(self) -> SchedulerCache:
        """The cache, once the workers' handshake opened it (ConfigError before)."""
        if self._opened is None:
            raise ConfigError(
                "tiered_kv: no handshake from the workers reached the scheduler (unsupported executor?)"
            )
        return self._opened

    @property
    def proxy(self) -> ProxyCopyEngine:
        return self.opened.proxy

    def close(self, why: str) -> None:
        """Fail the jobs in flight (vLLM stops its workers before the scheduler: no rank will report them),
        close the cache, stop the loop thread. Never raises: closing must not take the engine down."""
        try:
            if self._opened is not None:
                self._opened.proxy.abandon(why)
                self._loop.call(self._opened.aclose())
        except Exception:
            log.exception("tiered_kv: closing the scheduler cache failed")
        finally:
            self._loop.stop()

    # -- residency ---------------------------------------------------------------------------------
    def find_hit(self, rid: str, lookup: Callable[[Any], Hit | None]) -> Hit | None:
        """``lookup(cache)`` run on the loop (tails.Tails.find: the longest hit, its blocks touched); None
        for none, or when the lookup failed (logged: a miss)."""
        cache = self.opened.cache

        async def run() -> Hit | None:
            return lookup(cache)

        try:
            return self._loop.call(run())
        except Exception as exc:
            log.warning("tiered_kv: lookup for %s failed, treating it as a miss: %r", rid, exc)
            return None

    # -- the jobs a step plans (cross_process.step_jobs: each queued before the step's jobs are taken) --
    def start_stores(self, stores: Sequence[Store]) -> list[concurrent.futures.Future]:
        """Start each store, its jobs tagged; their outcomes (a failure is a future miss)."""
        cache = self.opened.cache
        tagged = [
            (tag, self._store(cache, keys, ids, prefix, hints, cold))
            for tag, keys, ids, prefix, hints, cold in stores
        ]
        return self._loop.call(start_stores(self.proxy, tagged))

    async def _store(
        self, cache: Any, keys: list[bytes], ids: list[int], prefix: list[bytes], hints: RequestHints, cold: bool
    ) -> None:
        res = await cache.store(
            keys, ids, prefix=prefix, session=hints.session, expect_followup=hints.expect_followup
        )
        if cold:  # a partial tail: dropped before any full block (tails.py)
            cache.manager.demote(keys)
        self._counters["stored_tail_blocks" if cold else "stored_blocks"] += getattr(res, "stored", 0)

    def load_later(
        self, tag: str, parts: Parts, *, grouped: bool, cold: Sequence[bytes] = ()
    ) -> concurrent.futures.Future:
        """Start an asynchronous load of ``parts`` ((keys, block ids) per group) without waiting for it:
        the blocks it landed (one count, or one per group when ``grouped``) come on the future. ``cold``:
        keys put back at the cold end once it ends (a partial tail it loaded, which the load touched)."""
        return self._loop.submit(run_tagged(tag, self._load(parts, grouped, cold)))

    def promote_later(self, keys: list[bytes], cold: Sequence[bytes] = ()) -> concurrent.futures.Future:
        """Start reading ``keys``' disk and Redis blocks into the CPU tier (TieredKVCache.promote) without
        waiting: the leading keys in the CPU tier once it ended come on the future (promotions.py)."""
        cache = self.opened.cache

        async def run() -> int:
            try:
                return await cache.promote(keys)
            finally:
                if cold:  # a partial tail stays the first to go (tails.py)
                    cache.manager.demote(cold)

        return self._loop.submit(run())

    def load_now(
        self, tag: str, parts: Parts, n_blocks: int, *, grouped: bool, cold: Sequence[bytes] = ()
    ) -> tuple[concurrent.futures.Future | None, int]:
        """A synchronous load: its job is queued for this step, or nothing is (step_jobs.start_sync_load;
        ``grouped``: every group's blocks or none)."""
        return self._loop.call(
            start_sync_load(self.proxy, tag, self._load(parts, grouped, cold), n_blocks, all_or_none=grouped)
        )

    def _load(self, parts: Parts, grouped: bool, cold: Sequence[bytes]) -> Coroutine[Any, Any, Any]:
        cache = self.opened.cache
        loads = [cache.load(keys, ids) for keys, ids in parts]
        load = gather_loads(loads) if grouped else loads[0]
        return _then_demote(cache, load, cold) if cold else load

    # -- sessions, reset, events, stats ----------------------------------------------------------------
    def release_after(
        self, session: str | int, stores: list[concurrent.futures.Future], then: Callable[[], None]
    ) -> None:
        """Once the request's stores resolved, make the session's chain the first to evict; then ``then``
        (off the loop). Returns at once."""
        cache = self.opened.cache

        async def release() -> None:
            if stores:  # a failed store is no reason to keep the session
                await asyncio.wait([asyncio.wrap_future(f) for f in stores])
            self._counters["released_blocks"] += len(cache.release(session))
            await asyncio.get_running_loop().run_in_executor(None, then)

        self._loop.submit(release())

    def reset(self) -> bool:
        """Every tier forgets every block (TieredKVCache.reset); False when it could not."""
        return bool(self._loop.call(self.opened.cache.reset()))

    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        """The tiers' events since the last call (kind, tier, keys)."""
        cache = self.opened.cache

        async def run() -> list[tuple[str, str, list[bytes]]]:
            return cache.take_events()

        return self._loop.call(run())

    def stats(self) -> dict[str, Any]:
        """The cache's stats ({} before it opened)."""
        if self._opened is None:
            return {}
        cache = self._opened.cache

        async def run() -> dict[str, Any]:
            return cache.stats()

        return self._loop.call(run())


async def _then_demote(cache: Any, load: Coroutine[Any, Any, Any], keys: Sequence[bytes]) -> Any:
    try:
        return await load
    finally:
        cache.manager.demote(keys)


def close_before_executors_exit(close: Callable[[], None]) -> None:
    """Close (flushing the disk tier) before concurrent.futures stops its executors at exit.

    vLLM may shut the connector down from a finalizer that runs after those
    executors are gone; hooks registered here run before them (last registered,
    first run), so a process that simply exits still leaves a flushed disk tier.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython: the plain atexit hook is the best there is
        import atexit

        atexit.register(close)
    else:
        register(close)
