"""TieredKVCache: the asyncio facade over the tier manager (bookkeeping) and the mover (bytes).

``lookup`` and ``touch`` are synchronous calls into the manager. ``store`` and
``load`` first plan at once: when nothing must wait (no spill or promotion, no
room or in-flight key to wait for) and the engine copies inline (host engines,
small batches), they copy and commit within the call, with no suspension point,
so no cancellation can come between. Otherwise the plan runs as a task the cache
owns: the mover executes its jobs in order (spill of evicted slots, promotion
from disk, the GPU copy), and the manager commits or aborts once every copy of
the plan has landed. A caller's cancellation stops the move before its next copy
and the caller still waits for the copies already issued (see ``_run``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .block_ids import check_block_ids
from .byte_budget import ByteBudget
from .capacity import cpu_rows, promote_chunk, remote_blocks, staging_rows, tier_slots
from .config import Config, check_capacities, load_config
from .core import core
from .errors import BlockIdError, HintError, LayoutError
from .identity import disk_namespace, make_keyer, remote_namespace
from .keys import check_keys
from .layout import KVLayout
from .lifecycle import Lifecycle
from .manager import LookupResult, TierManager
from .manager.key_rows import key_rows
from .manager.tier_index import READY
from .metrics import CacheMetrics
from .mover import DiskIO, Mover, load_handler, store_handler
from .mover.gpu_cpu import inline_handler, threaded_starter
from .moves import Moves, StoreResult, _Op
from .tiers.cpu import CpuSlabs
from .transfer import CopyEngine, make_engine
from .transfer.base import Compute, Direction, check_compute, compute_event
from .waits import wait_to_end

log = logging.getLogger(__name__)
T = TypeVar("T")


class TieredKVCache(Moves, Lifecycle):
    """Async context manager over a bound KVLayout (see layout.KVLayout.from_tensors).

    ``rank``/``world_size`` (or an engine-supplied ``shard_id``) name the engine's
    shard of the KV: each shard has its own keys and its own disk namespace.
    """

    def __init__(
        self,
        config: Config | str | dict | None,
        layout: KVLayout,
        *,
        metrics: CacheMetrics | None = None,
        rank: int = 0,
        world_size: int = 1,
        shard_id: str | None = None,
        slabs_factory: Callable[[KVLayout, int], Any] | None = None,
        engine_factory: Callable[[Any], Any] | None = None,
    ):
        self.config = cfg = load_config(config)
        if not isinstance(layout, KVLayout) or not (layout.is_bound or engine_factory is not None):
            raise LayoutError("TieredKVCache needs a layout bound to the KV tensors (KVLayout.from_tensors or bind)")
        # Injected by a scheduler process (split/scheduler.py): its slab is the shared segment and its
        # engine sends the copies to the workers; everything else is this same cache.
        self._slabs_factory = slabs_factory or self._local_slabs
        self._engine_factory = engine_factory
        check_capacities(cfg, layout.bytes_per_block)
        self.layout = layout
        self.metrics = metrics or CacheMetrics()
        # The geometry check, the keys and the slot counts come from the same functions a
        # scheduler process uses (identity.make_keyer, capacity.tier_slots).
        self.keyer = make_keyer(cfg, layout, rank=rank, world_size=world_size, shard_id=shard_id)
        self._key_bytes = self.keyer.key_bytes
        self._slots = tier_slots(cfg, layout)
        self._max_promote, self._staging = promote_chunk(cfg, layout), staging_rows(cfg, layout)
        self.manager = self._new_manager()
        self.metrics.track_used_slots("cpu", lambda: self.manager.cpu.used)
        if self.manager.disk is not None:
            self.metrics.track_used_slots("disk", lambda: self.manager.disk.used)
        self._disk_ns = disk_namespace(self.keyer, layout) if cfg.tiers.disk.enabled else None
        self._budget = ByteBudget(cfg.transfer.max_inflight_bytes)
        self.mover = Mover(self._budget, self.metrics, layout.bytes_per_block)
        self.disk: DiskIO | None = None
        self.remote = None  # mover.remote_io.RemoteIO while a remote tier is configured and open
        self._probing: asyncio.Task | None = None
        self.slabs: CpuSlabs | None = None
        self._engine: CopyEngine | None = None
        self.recovered_blocks = 0
        self._progress: asyncio.Future[None] | None = None  # resolved (and replaced) whenever a plan completes
        Lifecycle.__init__(self)

    def _new_manager(self) -> TierManager:
        cfg = self.config
        return TierManager(
            self._slots["cpu"], self._slots.get("disk"), self._key_bytes, cfg.eviction.policy,
            write_through=cfg.tiers.disk.spill_policy == "write_through", on_event=self._count_event,
            staging_slots=self._staging, protect_share=cfg.eviction.protect_share,
            session_idle_s=cfg.eviction.session_idle_s,
        )  # fmt: skip

    def _count_event(self, kind: str, tier: str, n: int) -> None:
        if kind == "evicted":
            self.metrics.evicted[tier].inc(n)
        elif kind == "dropped" and tier == "cpu":  # disk drops are counted where their error is seen
            self.metrics.drop("cpu", "no_disk_room", n)

    # -- lifecycle (see lifecycle.Lifecycle: all or nothing, one close task) -------------
    async def _open_resources(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        # Allocating and pinning a large slab takes seconds: keep it off the loop.
        rows = cpu_rows(cfg, self.layout)  # the same number a shared segment is sized by
        self.slabs = await loop.run_in_executor(None, self._slabs_factory, self.layout, rows)
        if self._engine_factory is not None:
            self._engine = engine = self._engine_factory(self.slabs)
        else:
            self._engine = engine = make_engine(cfg.transfer.engine, list(self.layout.regions), self.slabs.regions,
                                                dma_rows=self.slabs.dma_rows)  # fmt: skip
        self.mover.register("gpu", "cpu", store_handler(engine))
        self.mover.register("cpu", "gpu", load_handler(engine))
        for (src, dst), direction in ((("gpu", "cpu"), Direction.STORE), (("cpu", "gpu"), Direction.LOAD)):
            inline, threaded = inline_handler(engine, direction), threaded_starter(engine, direction)
            if inline is not None:
                self.mover.register_inline(src, dst, inline)
            if threaded is not None:
                self.mover.register_threaded(src, dst, threaded)
        if self._disk_ns is not None:
            self.disk, recovered = await DiskIO.open(cfg.tiers.disk, self._disk_ns, self._slots["disk"],
                                                     self.slabs, self.metrics, self._disk_degraded)  # fmt: skip
            self.manager.disk.restore([b.key for b in recovered], [b.slot for b in recovered])
            self.recovered_blocks = len(recovered)
            self.mover.register("cpu", "disk", self.disk.write)
            self.mover.register("disk", "cpu", self.disk.read)
        if cfg.tiers.remote.enabled:
            from .mover.remote_io import RemoteIO  # redis-py is an optional extra

            self.remote = remote = await RemoteIO.open(
                cfg.tiers.remote, remote_namespace(self.keyer, self.layout), self.slabs, self.metrics,
                remote_blocks(cfg, self.layout))  # fmt: skip
            self.mover.register("cpu", "remote", remote.write)
            self.mover.register("remote", "cpu", remote.read)
            self.manager.attach_remote(remote.known, cfg.tiers.remote.write)

    def _local_slabs(self, layout: KVLayout, rows: int) -> CpuSlabs:
        cpu = self.config.tiers.cpu
        return CpuSlabs(layout, rows, pin=cpu.pin_memory, pin_chunk=cpu.pin_chunk, device=layout.device)

    def _disk_degraded(self) -> None:
        self.manager.stop_disk_writes()

    async def _release_resources(self) -> None:
        """Release in reverse; slabs only after the copy engine has drained every copy."""
        drained = self._engine is None
        try:
            if self._engine is not None:
                await self._engine.aclose()  # waits for every copy first
            drained = True
            if self._probing is not None:
                self._probing.cancel()
            if self.remote is not None:
                remote, self.remote = self.remote, None
                await remote.aclose()
            if self.disk is not None:
                disk, self.disk = self.disk, None
                await disk.store.aclose()
        finally:
            if self.slabs is not None and drained:  # never unregister memory a copy may still touch
                self.slabs.release()
                self.slabs = None

    def _reset_after_failed_start(self) -> None:
        self.manager = self._new_manager()
        self.recovered_blocks = 0

    # -- control path -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest leading run of resident keys, per tier; no I/O, O(len(keys)), vectorized.

        Non-bytes keys or a wrong total length raise KeyFormatError; two keys whose
        wrong lengths cancel out are not detected here (checking each key would cost
        as much as the lookup), and can only miss.
        """
        self._check_open()
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            check_keys(keys, self._key_bytes)
        try:
            # Joining the keys checks their type and total length at C speed.
            result = self.manager.lookup(keys)
        except (TypeError, ValueError):
            check_keys(keys, self._key_bytes)  # names the bad key
            raise
        m = self.metrics
        m.lookups.inc(len(keys))
        m.hit["cpu"].inc(result.cpu)
        m.hit["disk"].inc(result.disk)
        m.hit["remote"].inc(result.remote)
        if self.remote is not None and result.total < len(keys):
            self._probe_later(keys[result.total :])
        return result

    async def probe(self, keys: Sequence[bytes]) -> LookupResult:
        """Ask the remote tier (one pipelined round trip) which of the keys past the local run it
        holds, then look up. Without a remote tier this is ``lookup``. Never raises for Redis faults."""
        result = self.lookup(keys)
        if self.remote is not None and result.total < len(keys):
            rest = keys[result.total :]
            await self.remote.probe(key_rows(rest, self._key_bytes))
            result = self.lookup(keys)
        return result

    def _probe_later(self, keys: Sequence[bytes]) -> None:
        """``lookup`` never waits on the network: unknown keys are probed in the background (one probe
        at a time), so a later lookup of the same prefix, here or on the engine's next poll, sees them."""
        if self._probing is not None and not self._probing.done():
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called off the loop thread: nothing to schedule on
            return
        rows = key_rows(keys[:4096], self._key_bytes)
        rows = rows[~self.remote.residency.known(rows)]
        if len(rows) and not self.remote.store.degraded:
            self._probing = self.spawn(self.remote.probe(rows), background=True)

    def touch(
        self, keys: Sequence[bytes], *, session: str | int | None = None, expect_followup: bool = False,
        held: bool = False,
    ) -> None:
        """Mark resident keys as used, last first, so a prefix's head is the most recent.

        ``session``: the keys are that live session's current chain (see ``release``);
        ``expect_followup``: the frontend expects its next turn, so its blocks are
        protected: they outrank every block of no protected session in every tier, up to
        ``eviction.protect_share`` of the CPU + disk slots over all sessions (the oldest lose it
        first), until the session ends, idles past ``eviction.session_idle_s`` or a turn comes
        without ``expect_followup``.
        ``held``: the engine's own prefix cache holds these blocks (a hit there): the reference is
        recorded (the key's history, for the next time the engine stores it) and copies the engine
        loaded stay the first eviction candidates.
        """
        self._check_open()
        check_keys(keys, self._key_bytes)
        self.manager.touch(keys, held=bool(held))
        if session is not None:
            self.manager.hint(_check_session(session), keys, bool(expect_followup))

    def release(self, session: str | int) -> list[bytes]:
        """The session ended: its chain's blocks no live session shares become the first to evict.

        They are dropped, never spilled, when room is needed. Returns those keys, so an
        engine can treat its own copies the same way. An unknown session returns [].
        """
        self._check_open()
        return self.manager.release(_check_session(session))

    async def wait_for(self, keys: Sequence[bytes]) -> LookupResult:
        """Wait until no key of the leading run is in flight; returns the lookup then."""
        result = self.lookup(keys)
        while result.pending:
            op = _Op()
            await self._wait_progress(op)
            result = self.lookup(keys)
        return result

    def tiers_of(self, keys: Sequence[bytes]) -> list[str]:
        """The tier each key is in: "cpu", "disk", "remote" (known to the remote residency filter) or ""."""
        self._check_open()
        check_keys(keys, self._key_bytes)
        return self.manager.tiers_of(keys)

    async def reset(self) -> bool:
        """Forget every block of every tier (the KV of old weights, after an update): the CPU tier's
        index and the policies' history start empty, every disk record is invalidated in the journal
        (a restart recovers none), the remote namespace is emptied on every server.

        Returns False, changing nothing, while a load, store or spill is in flight: a reset never
        races a copy (try again once they have finished). A remote tier that cannot be emptied
        (unreachable) is logged and counted; the local tiers are reset all the same.
        """
        self._check_open()
        busy = [t for t in self._tasks if not t.done() and t is not self._probing]
        if busy or self._budget.used or getattr(self._engine, "inflight", 0):
            return False
        old = self.manager
        disk_slots = np.flatnonzero(old.disk.state == READY) if old.disk is not None else None
        self.manager = self._new_manager()  # the check above and this swap: no await between them
        if not old.disk_writable:
            self.manager.stop_disk_writes()
        if self.remote is not None:
            self.manager.attach_remote(self.remote.known, self.config.tiers.remote.write)
        if self._probing is not None:
            self._probing.cancel()
        if self.disk is not None and disk_slots is not None and len(disk_slots):
            self.disk.invalidate(disk_slots)
            await self.disk.store.flush()  # journaled before the call returns: a restart recovers none
        if self.remote is not None:
            from .errors import RemoteError

            try:
                await self.remote.purge()
            except RemoteError as exc:
                log.warning("tiered_kv reset: the remote tier's namespace could not be emptied: %s", exc)
        return True

    def copies_now(self, n_blocks: int) -> bool:
        """Whether a copy of ``n_blocks`` would start at once: the byte budget
        (``transfer.max_inflight_bytes``) has room and nobody waits for it."""
        return self._budget.admits_now(n_blocks * self.layout.bytes_per_block)

    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        """(kind, tier, keys) since the last call: stored, evicted, spilled, dropped (for a router)."""
        return self.manager.take_events()

    def stats(self) -> dict[str, Any]:
        cpu = self.manager.cpu
        out: dict[str, Any] = {
            "cpu": {"slots": cpu.num_slots, "used": cpu.used, "resident": cpu.n_ready},
            "bytes_per_block": self.layout.bytes_per_block,
            "inflight_bytes": self._budget.used,
            # Which copy the engine chose at start (table, table-direct, groups, host-rows): issue 38.
            "copy_path": getattr(self._engine, "copy_path", None),
        }
        if self.remote is not None:
            out["remote"] = {"known": len(self.remote.residency), "degraded": self.remote.store.degraded}
        disk = self.manager.disk
        if disk is not None:
            out["disk"] = {
                "slots": disk.num_slots,
                "used": disk.used,
                "resident": disk.n_ready,
                "degraded": self.disk.degraded if self.disk is not None else None,
                "recovered": self.recovered_blocks,
            }
        out["metrics"] = self.metrics.snapshot()
        return out

    def check_invariants(self) -> None:
        """Every slot accounted for (tests call this after stress)."""
        self.manager.check_invariants()

    # -- data path ----------------------------------------------------------------------
    async def store(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int],
        *,
        prefix: Sequence[bytes] = (),
        session: str | int | None = None,
        expect_followup: bool = False,
        after: Awaitable[Any] | None = None,
        compute: Compute = None,
    ) -> StoreResult:
        """Copy the GPU blocks of keys not yet resident into CPU slots.

        ``prefix``: the keys of the chain before ``keys[0]`` when this call stores a
        continuation (the next chunk of a chunked prefill). The chain's resident blocks
        are never evicted to make room for it, and the whole chain is touched, head most
        recent, so no block outlives its parent. ``session``, ``expect_followup``: see ``touch``.
        ``after``: the store waits for it before it takes any room, and meanwhile its keys
        count as in flight (``lookup``'s ``pending``): a concurrent load waits for them
        instead of missing them. An engine saving blocks its own cache is about to reuse
        announces them this way and lets them in once room has been freed.
        ``compute``: see ``load``; the copies read the blocks only after it.
        """
        t0 = time.perf_counter()  # not loop.time(): uvloop's ticks in whole milliseconds
        ids = self._check_args(keys, gpu_block_ids)
        compute = self._compute_event(compute)
        if len(prefix):
            check_keys(prefix, self._key_bytes)
        keys, prefix = list(keys), list(prefix)
        if session is not None:
            self.manager.hint(_check_session(session), prefix + keys, bool(expect_followup))
        if after is None:
            result, plan = self._store_now(keys, ids, prefix)
            if result is not None:
                if not isinstance(result, StoreResult):
                    result = await result  # the copy on the engine's thread (a cancel waits for it to land)
                self.metrics.op_latency["store"].observe(time.perf_counter() - t0)
                return result
            return await self._run(lambda op: self._store_body(op, keys, ids, prefix, plan), "store", compute, t0)
        self.manager.announce(keys)
        return await self._run(lambda op: self._store_after(op, after, keys, ids, prefix), "store", compute)

    async def load(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int],
        *,
        exclusive: bool = False,
        before_copy: Callable[[], Awaitable[Any]] | None = None,
        compute: Compute = None,
    ) -> int:
        """Load the leading resident keys into the GPU blocks; returns how many were loaded.

        Waits for keys still in flight (``lookup``'s ``pending``). ``exclusive=True`` is the
        engine's promise that it keeps the loaded blocks and stores them back when its
        own cache evicts them: their copies here become first eviction candidates, so
        the engine's cache and this one hold each block once (see README, "Tiers").
        Disk and remote hits then go through staging rows, displacing no CPU block.
        ``before_copy`` is awaited once, after the first chunk's disk and remote reads
        landed and before anything is copied into the GPU blocks (or before returning
        when nothing is): an engine that must first save what those GPU blocks held
        stores it there, into the room the reads just freed.
        ``compute``: what the GPU copies are ordered after, a ``torch.cuda.Event`` the caller
        recorded on its compute stream or that ``torch.cuda.Stream`` (an event is recorded
        on it now, at the call). Without it the copies wait for the current stream of the
        event loop's thread at the time each copy is submitted, which orders them after the
        model only if the model runs on that stream (see README, "Ordering against the GPU").
        Ignored by the host engine (CPU tensors).
        """
        t0 = time.perf_counter()
        ids = self._check_args(keys, gpu_block_ids)
        compute = self._compute_event(compute)
        keys = list(keys)
        plan = None
        if before_copy is None:
            loaded, plan = self._load_now(keys, ids, bool(exclusive))
            if loaded is not None:
                if not isinstance(loaded, int):
                    loaded = await loaded  # the copy on the engine's thread (a cancel waits for it to land)
                self.metrics.op_latency["load"].observe(time.perf_counter() - t0)
                return loaded

        def body(op: _Op) -> Awaitable[int]:
            op.before_copy = before_copy
            return self._load_body(op, keys, ids, bool(exclusive), plan)

        return await self._run(body, "load", compute, t0)

    def _compute_event(self, compute: Compute) -> Compute:
        """A stream becomes an event recorded at the call (CUDA tensors only); anything else is checked."""
        if self.layout.device.type != "cuda":
            check_compute(compute)
            return None
        return compute_event(compute)

    def _check_args(self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> np.ndarray:
        """Validate a call before anything is reserved; returns the block ids as an int64 array."""
        self._check_open()
        check_keys(keys, self._key_bytes)
        ids = core.block_ids(gpu_block_ids, self.layout.num_blocks)  # one native pass for plain ints
        if ids is None:
            ids = check_block_ids(gpu_block_ids, self.layout.num_blocks)
        if len(keys) != len(ids):
            raise BlockIdError(f"{len(keys)} keys but {len(ids)} gpu_block_ids")
        return ids

    async def _run(self, body: Callable[[_Op], Awaitable[T]], op_name: str, compute: Compute = None,
                   t0: float | None = None) -> T:  # fmt: skip
        """Run a move as a task the cache owns; the caller waits for it, cancelled or not.

        On cancellation the flag stops the move before its next copy, and the caller
        still waits (shielded) until the copies already issued into or out of its
        GPU blocks have landed: the engine reuses those blocks the moment we return.
        """
        op = _Op()
        op.compute = compute
        if t0 is None:
            t0 = time.perf_counter()  # not loop.time(): uvloop's ticks in whole milliseconds
        task = self.spawn(body(op))

        def stop() -> None:
            op.cancelled = True
            if op.idle:  # waiting for room or another call: nothing reserved, nothing copying
                task.cancel()

        result = await wait_to_end(task, stop)
        self.metrics.op_latency[op_name].observe(time.perf_counter() - t0)
        return result

def _check_session(session: object) -> str | int:
    if isinstance(session, bool) or not isinstance(session, (str, int)):
        raise HintError(f"session must be a str or int id, got {type(session).__name__}")
    return session
