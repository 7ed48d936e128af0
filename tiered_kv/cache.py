"""TieredKVCache: the asyncio facade that holds and wires the tier manager, the runners and the lifecycle.

A move runs in three phases: plan (synchronous: manager/), execute (asynchronous: a runner of transfer/runners/
hands the plan's jobs to the dispatcher, which runs each through its handler and copy engine), finish
(synchronous: the manager commits or aborts). ``lookup``, ``touch`` and ``demote`` call the manager; ``store``
and ``load`` check their arguments here and hand the call to a runner.
Every part gets its collaborators as constructor arguments: the manager and the dispatcher at
construction, the resources (cache_resources.py) and the runners at start, new runners at ``reset``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from .byte_budget import ByteBudget
from .cache_args import call_blocks, check_session, compute_for, store_chain
from .cache_resources import CacheResources
from .capacity import promote_chunk, staging_rows, tier_slots
from .config import Config, check_capacities, load_config
from .errors import LayoutError
from .identity import make_keyer
from .keys import check_keys
from .layout import KVLayout
from .lifecycle import Lifecycle
from .manager import LookupResult, TierManager
from .manager.key_rows import key_rows
from .manager.tier_index import READY
from .metrics import CacheMetrics
from .owned_tasks import TaskSet
from .tiers.cpu import CpuSlabs
from .transfer import CopyEngine, make_engine
from .transfer.engines.base import Compute
from .transfer.handlers import Dispatcher
from .transfer.runners import MoveControl, Progress, Runners, StoreResult

__all__ = ["StoreResult", "TieredKVCache"]


class TieredKVCache:
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
            raise LayoutError(
                "TieredKVCache needs a layout bound to the KV tensors (KVLayout.from_tensors or bind)"
            )
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
        self._budget = ByteBudget(cfg.transfer.max_inflight_bytes)
        self.dispatcher = Dispatcher(self._budget, self.metrics, layout.bytes_per_block)
        # The factories are injected by a scheduler process (cross_process/): its slab is the shared
        # segment and its engine sends the copies to the workers; everything else is this same cache.
        self._res = CacheResources(cfg, layout, self.keyer, self._slots.get("disk"), slabs_factory=slabs_factory,
                                   engine_factory=engine_factory or self._local_engine)  # fmt: skip
        self._tasks = TaskSet()
        self._progress = Progress()  # every runner's plans wake its waiters
        self._runners: Runners | None = None  # while the cache is open
        self.recovered_blocks = 0
        self.lifecycle = Lifecycle(
            type(self).__name__,
            self._tasks,
            open_resources=self._open_resources,
            release_resources=self._res.release,
            reset_after_failed_start=self._reset_after_failed_start,
        )

    def _new_manager(self) -> TierManager:
        cfg = self.config
        return TierManager(
            self._slots["cpu"],
            self._slots.get("disk"),
            self._key_bytes,
            cfg.eviction.policy,
            write_through=cfg.tiers.disk.spill_policy == "write_through",
            on_event=self.metrics.manager_event,
            staging_slots=self._staging,
            protect_share=cfg.eviction.protect_share,
            session_idle_s=cfg.eviction.session_idle_s,
        )

    # -- what a started cache holds (cache_resources.py) --------------------------------
    @property
    def slabs(self) -> Any:
        return self._res.slabs

    @property
    def engine(self) -> CopyEngine | None:
        """The copy engine between the GPU blocks and the CPU slab, while the cache is open."""
        return self._res.engine

    disk = property(lambda self: self._res.disk)
    remote = property(lambda self: self._res.remote)
    runners = property(lambda self: self._runners, doc="The data path's runners while open (cache_sync.py).")

    # -- lifecycle (lifecycle.py: all or nothing, one close task) -----------------------
    async def start(self) -> TieredKVCache:
        await self.lifecycle.start()
        return self

    async def aclose(self) -> None:
        """Drain every in-flight move, then release threads, files and pinned memory. Idempotent."""
        await self.lifecycle.aclose()

    async def __aenter__(self) -> TieredKVCache:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _open_resources(self) -> None:
        await self._res.open(self.dispatcher, self.metrics, lambda: self.manager.stop_disk_writes())
        recovered = self._res.recovered
        self.manager.restore_disk([b.key for b in recovered], [b.slot for b in recovered])
        self.recovered_blocks = len(recovered)
        self._wire()

    def _wire(self) -> None:
        """Build the runners over the current manager and the open resources."""
        if self.remote is not None:
            self.manager.attach_remote(self.remote.known, self.config.tiers.remote.write)
        self._runners = Runners.build(
            self.manager,
            self.dispatcher,
            self.metrics,
            self._tasks,
            self._progress,
            max_promote=self._max_promote,
            disk=self.disk,
            remote=self.remote,
        )

    def _local_engine(self, slabs: CpuSlabs) -> CopyEngine:
        regions = list(self.layout.regions)
        return make_engine(self.config.transfer.engine, regions, slabs.regions, dma_rows=slabs.dma_rows)

    def _reset_after_failed_start(self) -> None:
        self.manager = self._new_manager()
        self.recovered_blocks = 0

    # -- control path -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest leading run of resident keys, per tier; no I/O, O(len(keys)), vectorized. Non-bytes keys or
        a wrong total length raise KeyFormatError (two wrong lengths that cancel out can only miss)."""
        self.lifecycle.check_open()
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
            self.remote.probe_later(keys[result.total :], self._key_bytes, self._tasks)
        return result

    async def probe(self, keys: Sequence[bytes]) -> LookupResult:
        """Ask the remote tier (one pipelined round trip) which of the keys past the local run it
        holds, then look up. Without a remote tier this is ``lookup``. Never raises for Redis faults."""
        result = self.lookup(keys)
        if self.remote is not None and result.total < len(keys):
            await self.remote.probe(key_rows(keys[result.total :], self._key_bytes))
            result = self.lookup(keys)
        return result

    def touch(
        self,
        keys: Sequence[bytes],
        *,
        session: str | int | None = None,
        expect_followup: bool = False,
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
        self.lifecycle.check_open()
        check_keys(keys, self._key_bytes)
        self.manager.touch(keys, held=bool(held))
        if session is not None:
            self.manager.hint(check_session(session), keys, bool(expect_followup))

    def demote(self, keys: Sequence[bytes]) -> int:
        """``keys``' resident blocks first to go in every tier, dropped, never spilled (``touch`` undoes it)."""
        check_keys(keys, self._key_bytes)
        return self.manager.demote(keys)

    def release(self, session: str | int) -> list[bytes]:
        """The session ended: its chain's blocks no live session shares become the first to evict (dropped,
        never spilled). Returns those keys, so an engine can treat its own copies the same way ([]: unknown)."""
        self.lifecycle.check_open()
        return self.manager.release(check_session(session))

    async def wait_for(self, keys: Sequence[bytes]) -> LookupResult:
        """Wait until no key of the leading run is in flight; returns the lookup then."""
        result = self.lookup(keys)
        while result.pending:
            await self._progress.wait(MoveControl())
            result = self.lookup(keys)
        return result

    def tiers_of(self, keys: Sequence[bytes]) -> list[str]:
        """The tier each key is in: "cpu", "disk", "remote" (known to the remote residency filter) or ""."""
        self.lifecycle.check_open()
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
        self.lifecycle.check_open()
        probing = self.remote.probing if self.remote is not None else None
        busy = [t for t in self._tasks if not t.done() and t is not probing]
        if busy or self._budget.used or self.engine.inflight:
            return False
        old = self.manager
        disk_slots = np.flatnonzero(old.disk.state == READY) if old.disk is not None else None
        self.manager = self._new_manager()  # the check above and this swap: no await between them
        if not old.disk_writable:
            self.manager.stop_disk_writes()
        self._wire()
        if self.remote is not None:
            self.remote.stop_probing()
        await self._runners.spills.forget(disk_slots)
        return True

    async def promote(self, keys: Sequence[bytes]) -> int:
        """Read the leading run's disk and Redis blocks into CPU slots (a load without its GPU copy; waits
        for keys in flight); returns how many leading keys are in the CPU tier then (at most its slots)."""
        self.lifecycle.check_open()
        check_keys(keys, self._key_bytes)
        keys = list(keys)[: self.manager.cpu.num_slots]  # more would evict the run's own head
        await self._runners.loads.promote(keys)
        return self.manager.lookup(keys).cpu

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
            "copy_path": self.engine.copy_path,
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

    # -- data path (transfer/runners/) ---------------------------------------------------
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
        ids = call_blocks(self, keys, gpu_block_ids)
        compute = compute_for(self.layout.device, compute)
        keys, prefix = store_chain(self, keys, prefix, session, expect_followup)
        result = await self._runners.stores.store(keys, ids, prefix, after, compute)
        self.metrics.op_latency["store"].observe(time.perf_counter() - t0)
        return result

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
        ids = call_blocks(self, keys, gpu_block_ids)
        compute = compute_for(self.layout.device, compute)
        loaded = await self._runners.loads.load(list(keys), ids, bool(exclusive), before_copy, compute)
        self.metrics.op_latency["load"].observe(time.perf_counter() - t0)
        return loaded
