"""``tiered-kv replay --instances N``: N serving instances behind a router, sharing one Redis.

Each instance is what ``replay_async`` runs for one: its own emulated GPU KV tensors,
its own TieredKVCache (its own CPU tier, and its own fresh disk directory when the disk
tier is on) and its own EngineEmulator. They all share ``tiers.remote`` and one event
loop. A block one instance computed reaches Redis when it is stored (write-through; in the
emulator's exclusive mode, when that instance's GPU evicts it), and another instance finds
it with a probe before its load: those are the cross-instance hits.

Requests start in trace order across the fleet (a router with one queue): each goes to
the instance its route picks, and waits while that instance already runs
``replay.concurrency`` requests. Capacity and concurrency settings apply per instance.

Unless ``keep_disk``, a run writes under its own Redis key prefix (``key_prefix`` +
``replay-<pid>-<random>:``) and removes those keys afterwards, so an earlier run's
blocks never count as hits, as with the fresh disk directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, fields
from typing import Any

from ..cache import TieredKVCache
from ..config import Config, load_config
from ..errors import ConfigError
from ..loops import run as run_loop
from ..tier_config import RemoteTierConfig
from .engine import EngineEmulator, EngineStats
from .instance import new_cache, new_emulator
from .run import (
    BLOCK_TOKENS,
    ReplayResult,
    check_pacing,
    fresh_disks,
    replay_async,
    replay_result,
)
from .trace import Request

log = logging.getLogger(__name__)

ROUTES = ("round_robin", "session")
CLEAR_TIMEOUT_S = 60.0  # removing a run's keys is best effort: a slow or gone server is only logged


@dataclass
class FleetResult:
    instances: list[ReplayResult]  # one per instance, in instance order
    total: ReplayResult  # the fleet as one: summed stats, metrics and capacities, the fleet's wall time
    route: str


def check_fleet_options(
    cfg: Config, *, metrics_port: int | None = None, plot: object = None, keep_disk: bool = False
) -> None:
    """Refuse option combinations a fleet replay cannot honour (ConfigError naming them)."""
    n = cfg.replay.instances
    if n > 1 and not cfg.tiers.remote.enabled:
        raise ConfigError(
            f"tiers.remote.enabled: --instances {n} (replay.instances) shares blocks between the instances "
            "through the remote tier, which is off; set tiers.remote.enabled: true and tiers.remote.url, "
            "or use --instances 1"
        )
    if n > 1 and metrics_port is not None:
        raise ConfigError(f"--metrics-port serves one cache's metrics; not with --instances {n}")
    if n > 1 and keep_disk and cfg.tiers.disk.enabled:
        raise ConfigError(
            f"--keep-disk: the {n} instances would share one disk directory (tiers.disk.path); "
            "drop --keep-disk (each instance then gets a fresh directory) or set tiers.disk.enabled: false"
        )
    if plot is not None and cfg.tiers.remote.enabled:
        raise ConfigError(
            "--plot sweeps capacities with single caches; with tiers.remote.enabled every point would share "
            "one Redis key space; set tiers.remote.enabled: false for --plot"
        )


class Router:
    """Instance of each request: round-robin, or sticky per session (a session's first turn is
    placed round-robin; requests without a session go round-robin)."""

    def __init__(self, route: str, instances: int) -> None:
        if route not in ROUTES:
            raise ConfigError(f"replay.route: {route!r} is not one of {', '.join(ROUTES)}")
        self.route, self.instances = route, instances
        self._next = 0
        self._sessions: dict[int, int] = {}  # live sessions only: a last turn forgets its session

    def __call__(self, req: Request) -> int:
        if self.route == "session" and req.session is not None:
            i = self._sessions.get(req.session)
            if i is None:
                i = self._sessions[req.session] = self._round_robin()
            if req.last_turn:
                del self._sessions[req.session]
            return i
        return self._round_robin()

    def _round_robin(self) -> int:
        i = self._next
        self._next = (i + 1) % self.instances
        return i


async def dispatch(
    engines: Sequence[EngineEmulator],
    requests: Sequence[Request],
    router: Callable[[Request], int],
    *,
    concurrency: int,
    speed: float = 0.0,
    on_done: Callable[[], None] | None = None,
) -> None:
    """Start ``requests`` in order, each on its routed engine, at most ``concurrency`` per engine.

    The first request that raises stops the dispatch; the others are cancelled (each
    emulator's request waits for its copies) before the error propagates.
    """
    loop = asyncio.get_running_loop()
    room = [asyncio.Semaphore(concurrency) for _ in engines]
    running: set[asyncio.Task] = set()
    start = loop.time()
    t_first = requests[0].timestamp_ms if requests else 0.0

    async def serve(i: int, req: Request) -> None:
        try:
            await engines[i].run_request(req)
        finally:
            room[i].release()
        if on_done is not None:
            on_done()

    def failure() -> BaseException | None:
        for task in running:
            if task.done() and not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    try:
        for req in requests:
            if speed > 0:
                delay = start + (req.timestamp_ms - t_first) / 1000.0 / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            i = router(req)
            await room[i].acquire()
            err = failure()
            if err is not None:
                raise err
            running = {t for t in running if not t.done()}  # finished ones succeeded (checked above)
            running.add(asyncio.ensure_future(serve(i, req)))
        if running:
            await asyncio.wait(running, return_when=asyncio.FIRST_EXCEPTION)
        err = failure()
        if err is not None:
            raise err
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def fleet_async(
    cfgs: Sequence[Config],
    requests: Sequence[Request],
    *,
    route: str = "round_robin",
    on_done: Callable[[], None] | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> list[ReplayResult]:
    """Replay ``requests`` over one instance per config (their disk paths are used as given)."""
    replay = cfgs[0].replay
    check_pacing(requests, replay.speed)
    router = Router(route, len(cfgs))
    caches: list[TieredKVCache] = []
    engines: list[EngineEmulator] = []
    async with AsyncExitStack() as stack:
        for cfg in cfgs:
            cache = new_cache(cfg)
            await stack.enter_async_context(cache)
            engine = new_emulator(cfg, cache, block_tokens)
            stack.callback(engine.close)  # runs before its cache closes (the stack unwinds last first)
            caches.append(cache)
            engines.append(engine)
        t0 = time.perf_counter()
        await dispatch(engines, requests, router, concurrency=replay.concurrency, speed=replay.speed,
                       on_done=on_done)  # fmt: skip
        stats = [cache.stats() for cache in caches]
    wall = time.perf_counter() - t0  # includes closing every cache (draining their writes)
    return [
        replay_result(cfg, engine, cache, st, wall, block_tokens)
        for cfg, engine, cache, st in zip(cfgs, engines, caches, stats, strict=True)
    ]


def run_fleet(
    cfg: Config,
    requests: Sequence[Request],
    *,
    keep_disk: bool = False,
    on_done: Callable[[], None] | None = None,
    metrics_port: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> FleetResult:
    """``replay.instances`` instances over the shared remote tier; one instance is ``replay_async``.

    Fresh disk directories and a fresh Redis key prefix unless ``keep_disk`` (see the module doc).
    """
    check_fleet_options(cfg, metrics_port=metrics_port, keep_disk=keep_disk)
    n, route = cfg.replay.instances, cfg.replay.route
    prefix = None
    if cfg.tiers.remote.enabled and not keep_disk:
        prefix = f"{cfg.tiers.remote.key_prefix}replay-{os.getpid()}-{secrets.token_hex(4)}:"
        data = cfg.model_dump()
        data["tiers"]["remote"]["key_prefix"] = prefix
        cfg = load_config(data)  # a ConfigError names tiers.remote.key_prefix if it grew too long

    async def body(cfgs: list[Config]) -> list[ReplayResult]:
        try:
            if n == 1:
                return [await replay_async(cfgs[0], requests, on_done=on_done, metrics_port=metrics_port,
                                           block_tokens=block_tokens)]  # fmt: skip
            return await fleet_async(cfgs, requests, route=route, on_done=on_done, block_tokens=block_tokens)
        finally:
            if prefix is not None:
                await _clear_quietly(cfg.tiers.remote, prefix)

    with fresh_disks(cfg, n, keep_disk=keep_disk) as cfgs:
        results = run_loop(body(cfgs))
    return FleetResult(results, merge_results(results), route)


def merge_results(results: Sequence[ReplayResult]) -> ReplayResult:
    """The fleet as one replay: counters and latencies pooled, capacities summed."""
    if len(results) == 1:
        return results[0]
    stats = EngineStats()
    for f in fields(EngineStats):
        values = [getattr(r.stats, f.name) for r in results]
        setattr(stats, f.name, [x for v in values for x in v] if isinstance(values[0], list) else sum(values))
    metrics: dict[str, float] = {}
    for r in results:
        for name, value in r.metrics.items():
            metrics[name] = metrics.get(name, 0.0) + value
    runs: dict[int, int] = {}
    for r in results:
        for k, n in r.slot_runs.items():
            runs[k] = runs.get(k, 0) + n
    first = results[0]
    return ReplayResult(
        stats=stats,
        metrics=metrics,
        wall_s=max(r.wall_s for r in results),
        gpu_blocks=sum(r.gpu_blocks for r in results),
        cpu_slots=sum(r.cpu_slots for r in results),
        disk_slots=sum(r.disk_slots for r in results),
        bytes_per_block=first.bytes_per_block,
        device=first.device,
        block_tokens=first.block_tokens,
        policy=first.policy,
        concurrency=first.concurrency,
        hints=first.hints,
        drop_partial=first.drop_partial,
        remote=first.remote,
        slot_runs=runs,
        slot_run_blocks=sum(r.slot_run_blocks for r in results),
    )


# -- removing a run's keys ------------------------------------------------------------------
async def _clear_quietly(cfg: RemoteTierConfig, prefix: str) -> None:
    try:
        removed = await asyncio.wait_for(clear_remote_prefix(cfg, prefix), CLEAR_TIMEOUT_S)
        log.info("removed %d replay keys under %r", removed, prefix)
    except Exception as exc:  # noqa: BLE001 - the replay's result stands; say what was left behind
        log.warning("could not remove the replay's Redis keys under %r: %s", prefix, exc)


async def clear_remote_prefix(cfg: RemoteTierConfig, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN + pipelined UNLINK on each server, every
    cluster primary included); returns how many went."""
    from redis.asyncio import Redis

    from ..tiers.remote.client import read_password

    kw: dict[str, Any] = {"socket_timeout": cfg.timeout, "socket_connect_timeout": cfg.timeout,
                          "password": read_password(cfg)}  # fmt: skip
    if cfg.cluster:
        clients = [Redis(host=host, port=port, ssl=cfg.url.startswith("rediss:"), **kw)
                   for host, port in await _primaries(cfg, kw)]  # fmt: skip
    else:
        clients = [Redis.from_url(cfg.url, **kw)]
    pattern = "".join("\\" + c if c in "\\*?[]" else c for c in prefix) + "*"
    removed = 0
    for client in clients:
        try:
            batch: list[bytes] = []
            async for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    removed += await _unlink(client, batch)
                    batch = []
            removed += await _unlink(client, batch)
        finally:
            await client.aclose()
    return removed


async def _unlink(client: Any, keys: list[bytes]) -> int:
    if not keys:
        return 0
    pipe = client.pipeline(transaction=False)
    for key in keys:  # one key per command: a cluster node refuses a multi-key UNLINK across slots
        pipe.unlink(key)
    return sum(await pipe.execute())


async def _primaries(cfg: RemoteTierConfig, kw: dict[str, Any]) -> list[tuple[str, int]]:
    from urllib.parse import urlsplit

    from redis.asyncio.cluster import ClusterNode, RedisCluster

    from ..redis_url import split_node

    url = urlsplit(cfg.url)
    seeds = [split_node(s) for s in cfg.nodes] or [(url.hostname or "127.0.0.1", url.port or 6379)]
    cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], ssl=cfg.url.startswith("rediss:"),
                           **kw)  # fmt: skip
    try:
        await cluster.initialize()
        return [(node.host, node.port) for node in cluster.get_primaries()]
    finally:
        await cluster.aclose()
