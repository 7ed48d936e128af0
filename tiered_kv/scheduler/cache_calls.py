"""Every call a scheduler makes into the cross-process cache, from the engine's thread (vLLM's, via its scheduler half).

The cache (``cross_process.SchedulerCache``: the TieredKVCache over the shared segment, and the proxy
engine whose jobs the workers copy) lives on an asyncio loop in a thread owned here
(``loops.LoopThread``), which keeps only I/O (disk and Redis reads and writes, spills, promotions) and
holds the cache's state lock (state_lock.py) but while it waits for it. vLLM's thread takes the same
lock (``locked``) and calls the cache directly: lookups, load and store planning (cache_sync.py; their
jobs are queued on the proxy at once), events, stats. Only a reset, the open and close, an
asynchronous load and what must wait for I/O hop onto the loop (counted: ``loop_calls_<hook>``).
The scheduler half (scheduler_half.py) keeps vLLM's request and step state and reaches the cache only
through this class and the proxy it hands out (``proxy``: the jobs to send, the ranks' reports, fences).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from ..cache_sync import load_sync, store_sync
from ..config import Config
from ..cross_process import (
    ProxyCopyEngine,
    SchedulerCache,
    gather_loads,
    open_scheduler_cache,
    request_scope,
    run_tagged,
)
from ..errors import ConfigError
from ..layout import KVLayout
from ..loops import LoopThread
from ..state_lock import StateLock, borrowed_loop, has_callbacks
from .hints import RequestHints
from .hits import Hit

log = logging.getLogger(__name__)

# tag, keys, block ids, prefix, hints, cold (a partial tail: put at the cold end once stored, tails.py)
Store = tuple[str, list[bytes], list[int], list[bytes], RequestHints, bool]
Parts = list[tuple[list[bytes], list[int]]]  # a load's (keys, block ids), one per KV cache group


class CacheCalls:
    """The scheduler's cache on its loop thread (module docstring); ``counters`` is the half's."""

    def __init__(self, counters: Counter[str]) -> None:
        self._lock = StateLock()
        self._loop = LoopThread("tiered-kv-scheduler", lock=self._lock)
        self._counters = counters
        self._hook: str | None = None
        self._opened: SchedulerCache | None = None
        self._closed = False  # close() ran: the cache is closed (or failed to), its loop thread stopped
        self._last_stats: dict[str, Any] = {}  # the cache's stats as close() found them

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
        """Opened by the workers' handshake and not closed since: the hooks may call the cache."""
        return self._opened is not None and not self._closed

    @property
    def state(self) -> str:
        """``new`` (no handshake yet), ``open`` or ``closed`` (close() ran, whether or not it succeeded)."""
        return "new" if self._opened is None else "closed" if self._closed else "open"

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
        if self._closed:
            return
        try:
            self._last_stats = self.stats()  # what report() shows once closed
        except Exception:
            log.exception("tiered_kv: the scheduler cache's stats could not be read before closing it")
        try:
            if self._opened is not None:
                with self.locked():
                    self._opened.proxy.abandon(why)
                self._loop.call(self._opened.aclose())
        except Exception:
            log.exception("tiered_kv: closing the scheduler cache failed")
        finally:
            self._closed = True
            self._loop.stop()

    # -- the state lock: vLLM's thread calls the cache directly (state_lock.py) -------------------
    @contextlib.contextmanager
    def locked(self, hook: str | None = None) -> Iterator[None]:
        """Hold the cache's state lock: the loop is parked between callbacks, and is this thread's running
        loop meanwhile (what the cache schedules on it runs once the lock is let go: the loop is woken).
        ``hook``: the half's hook this is, for the ``loop_calls_<hook>`` counters."""
        outer = not self._lock.held_by_me()
        self._lock.acquire()
        hook_before = self._hook
        try:
            if not outer:
                yield
                return
            self._hook = hook or self._hook
            with borrowed_loop(self._loop.loop):
                yield
        finally:
            self._hook = hook_before
            self._lock.release()
            if outer and has_callbacks(self._loop.loop):  # it has callbacks this call scheduled
                self._loop.wake()

    def _loop_call(self) -> None:
        """Count a hop onto the loop thread (``call`` or ``submit``) for the hook making it."""
        self._counters["loop_calls"] += 1
        self._counters[f"loop_calls_{self._hook or 'other'}"] += 1

    # -- residency ---------------------------------------------------------------------------------
    def find_hit(self, rid: str, lookup: Callable[[Any], Hit | None]) -> Hit | None:
        """``lookup(cache)`` (tails.Tails.find: the longest hit, its blocks touched), here, under the
        lock; None for none, or when the lookup failed (logged: a miss)."""
        cache = self.opened.cache
        try:
            with self.locked():
                return lookup(cache)
        except Exception as exc:
            log.warning("tiered_kv: lookup for %s failed, treating it as a miss: %r", rid, exc)
            return None

    # -- the jobs a step plans: queued in vLLM's thread, before the step's jobs are taken ------------
    def start_stores(self, stores: Sequence[Store]) -> list[concurrent.futures.Future]:
        """Plan each store here (cache_sync.store_sync), its jobs tagged; their outcomes (a failure is a
        future miss). One that must wait (room, a spill, the byte budget) runs on the loop: its job
        rides in a later step, its blocks held until it resolves."""
        out = []
        with self.locked():
            cache = self.opened.cache
            for tag, keys, ids, prefix, hints, cold in stores:
                with request_scope(tag):
                    try:
                        fut, rest = store_sync(cache, keys, ids, prefix=prefix, session=hints.session,
                                               expect_followup=hints.expect_followup)  # fmt: skip
                    except Exception as exc:
                        fut, rest = concurrent.futures.Future(), None
                        fut.set_exception(exc)
                if rest is not None:
                    self._loop_call()
                    fut = self._loop.submit(run_tagged(tag, rest))
                fut.add_done_callback(functools.partial(self._stored, cache, keys, cold))
                out.append(fut)
        return out

    def _stored(self, cache: Any, keys: list[bytes], cold: bool, fut: concurrent.futures.Future) -> None:
        """(under the lock: the report's or the loop's thread) A store's outcome: counted; a partial
        tail is put at the cold end (tails.py)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self.locked():
            if cold:
                cache.demote(keys)
            self._counters["stored_tail_blocks" if cold else "stored_blocks"] += getattr(fut.result(), "stored", 0)

    def load_later(
        self, tag: str, parts: Parts, *, grouped: bool, cold: Sequence[bytes] = ()
    ) -> concurrent.futures.Future:
        """Start an asynchronous load of ``parts`` ((keys, block ids) per group) without waiting for it:
        the blocks it landed (one count, or one per group when ``grouped``) come on the future. ``cold``:
        keys put back at the cold end once it ends (a partial tail it loaded, which the load touched)."""
        self._loop_call()
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
                    cache.demote(cold)

        return self._loop.submit(run())

    def load_now(
        self, tag: str, parts: Parts, n_blocks: int, *, grouped: bool, cold: Sequence[bytes] = ()
    ) -> tuple[concurrent.futures.Future | None, int]:
        """A synchronous load planned here (cache_sync.load_sync), its jobs queued for this step, or
        nothing is: (outcome, blocks planned). Blocks past the planned ones are never loaded (the tag is
        sealed). ``grouped``: every group's blocks or none (the queued ones are failed unsent)."""
        with self.locked():
            cache, proxy = self.opened.cache, self.proxy
            futures: list[concurrent.futures.Future] = []
            planned = 0
            with request_scope(tag):
                for keys, ids in parts:
                    if not keys:  # a group with nothing to load (all of its range computed by vLLM)
                        futures.append(concurrent.futures.Future())
                        futures[-1].set_result(0)
                        continue
                    fut, rest, n = load_sync(cache, keys, ids)
                    if rest is not None:  # a block left the CPU tier: its promotion runs, copying nothing
                        self._loop_call()
                        self._loop.submit(rest).add_done_callback(_ignore)
                    if fut is None or (fut.done() and fut.exception() is not None):
                        break  # nothing queued (a job refused at once is never sent either)
                    futures.append(fut)
                    planned += n
            if grouped and planned < n_blocks:
                proxy.cancel_request(tag)
                planned = 0
            proxy.seal_request(tag)
            if not planned:
                return None, 0
            return _joined(futures, grouped, lambda: cache.demote(cold) if cold else None), min(planned, n_blocks)

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
        self._loop_call()

        async def release() -> None:
            if stores:  # a failed store is no reason to keep the session
                await asyncio.wait([asyncio.wrap_future(f) for f in stores])
            self._counters["released_blocks"] += len(cache.release(session))
            await asyncio.get_running_loop().run_in_executor(None, then)

        self._loop.submit(release())

    def reset(self) -> bool:
        """Every tier forgets every block (TieredKVCache.reset); False when it could not."""
        self._loop_call()
        return bool(self._loop.call(self.opened.cache.reset()))

    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        """The tiers' events since the last call (kind, tier, keys)."""
        with self.locked():
            return self.opened.cache.take_events()

    def stats(self) -> dict[str, Any]:
        """The cache's stats ({} before it opened; once closed, the last ones it had)."""
        if self._opened is None or self._closed:
            return dict(self._last_stats)
        with self.locked():
            return self._opened.cache.stats()


def _ignore(fut: concurrent.futures.Future) -> None:
    fut.cancelled() or fut.exception()


def _joined(futures: list[concurrent.futures.Future], grouped: bool, then: Callable[[], Any]) -> concurrent.futures.Future:
    """One outcome for a load's parts: the blocks landed (one count, or one per group when ``grouped``:
    a failed group landed none); ``then`` runs once all ended (in the thread that ended the last)."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    left = [len(futures)]

    def one(_: concurrent.futures.Future) -> None:
        left[0] -= 1
        if left[0]:
            return
        try:
            then()
        finally:
            if not grouped:
                f = futures[0]
                out.set_exception(f.exception()) if f.exception() is not None else out.set_result(f.result())
            else:
                out.set_result([0 if f.exception() is not None else int(f.result()) for f in futures])

    for f in futures:
        f.add_done_callback(one)
    return out


async def _then_demote(cache: Any, load: Coroutine[Any, Any, Any], keys: Sequence[bytes]) -> Any:
    try:
        return await load
    finally:
        cache.demote(keys)


class ExitHook:
    """A hook threading runs at exit that calls ``close`` once, unless ``cancel`` dropped it first.

    threading has no way to unregister a hook, so the hook itself lets go of what it would close: an
    owner that closed (and cancelled its hook) is free to be collected, where a hook holding it would keep
    every scheduler half of a process that builds engine after engine. One that never closed stays
    reachable from here and is closed at exit, as before."""

    def __init__(self, close: Callable[[], None]) -> None:
        self._close: Callable[[], None] | None = close

    def __call__(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            close()

    def cancel(self) -> None:
        self._close = None


def close_before_executors_exit(close: Callable[[], None]) -> ExitHook:
    """Close (flushing the disk tier) before concurrent.futures stops its executors at exit.

    vLLM may shut the connector down from a finalizer that runs after those
    executors are gone; hooks registered here run before them (last registered,
    first run), so a process that simply exits still leaves a flushed disk tier.
    The owner cancels the returned hook once it closed by itself (ExitHook).
    """
    hook = ExitHook(close)
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython: the plain atexit hook is the best there is
        import atexit

        atexit.register(hook)
    else:
        register(hook)
    return hook
