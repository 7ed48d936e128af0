"""Replay orchestration: config overrides, the workload, one real replay, simulators, the CLI entry.

``run_replay`` is synchronous: it builds the emulated GPU KV tensors, opens a real
TieredKVCache over them on its own event loop (tiered_kv.loops: uvloop unless TIERED_KV_UVLOOP=0), replays
the requests and returns a ReplayResult. By default the disk tier lives in a
fresh ``<tiers.disk.path>/replay-<pid>`` directory removed afterwards, so a
stale namespace from an earlier run cannot serve disk hits from the first request.

Block tokens have one source: BLOCK_TOKENS, the size of a Mooncake ``hash_ids``
block and the size the built-in workload is generated with. It travels with the
replay (``ReplayResult.block_tokens``) to the emulator (which of a request's
blocks is partial), the simulators and the report.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache import TieredKVCache
from ..capacity import tier_slots
from ..config import PLACEHOLDER_MODEL_ID, Config, load_config, read_config_data, validate_config
from ..errors import ConfigError, LayoutError
from ..layout import KVLayout
from ..loops import run as run_loop
from ..policy import POLICIES
from . import simulate as sim
from .engine import EngineEmulator, EngineStats, run_requests
from .instance import new_cache, new_emulator
from .sizing import TierSplit, longest_request, split_capacity
from .trace import Request, read_trace
from .workload import chat_workload

log = logging.getLogger(__name__)

BLOCK_TOKENS = 512  # tokens per hash_ids block: Mooncake traces (their README) and the built-in workload


@dataclass
class ReplayResult:
    stats: EngineStats
    metrics: dict[str, float]  # the cache's flat prometheus snapshot after close
    wall_s: float
    gpu_blocks: int
    cpu_slots: int
    disk_slots: int
    bytes_per_block: int
    device: str
    block_tokens: int = BLOCK_TOKENS
    policy: str = "lru"
    concurrency: int = 1
    hints: bool = False
    drop_partial: bool = True
    remote: bool = False  # tiers.remote was on: hits_remote counts blocks served from Redis
    slot_runs: dict[int, int] = field(default_factory=dict)  # runs of consecutive CPU slots -> store plans
    slot_run_blocks: int = 0  # the blocks of those plans

    @property
    def total_blocks(self) -> int:
        return self.gpu_blocks + self.cpu_slots + self.disk_slots


# -- config and workload ---------------------------------------------------------------
def resolve_config(
    source: str | os.PathLike[str] | dict | Config | None,
    *,
    block_bytes: str | int | None = None,
    concurrency: int | None = None,
    speed: float | None = None,
    max_requests: int | None = None,
    policy: str | None = None,
    hints: bool | None = None,
    drop_partial: bool | None = None,
    instances: int | None = None,
    route: str | None = None,
) -> Config:
    """The config with CLI overrides applied; ``replay.block_bytes`` replaces the model geometry.

    ``policy`` replaces ``eviction.policy`` and is validated there (a ConfigError names the
    allowed policies), so a newly registered policy needs no change here.

    A config that leaves ``model.model_id`` at the placeholder may still run a disk tier
    here: the replay's bytes are synthetic and its disk directory is fresh per run.
    """
    where = "config"
    if isinstance(source, Config):
        data: Any = source.model_dump()
    elif isinstance(source, (str, os.PathLike)):
        where, data = str(source), read_config_data(source)
    else:
        data = dict(source or {})
    if isinstance(data, dict):
        _allow_placeholder(data)
    data = validate_config(data, where).model_dump()
    for name, value in (
        ("block_bytes", block_bytes),
        ("concurrency", concurrency),
        ("speed", speed),
        ("max_requests", max_requests),
        ("hints", hints),
        ("drop_partial", drop_partial),
        ("instances", instances),
        ("route", route),
    ):
        if value is not None:
            data["replay"][name] = value
    if policy is not None:
        data["eviction"]["policy"] = policy
    cfg = validate_config(data, "command-line options")  # a ConfigError names replay.<key>
    if cfg.replay.block_bytes is not None:
        m = cfg.model
        data["model"] = {
            "model_id": m.model_id,
            "revision": m.revision,
            "allow_placeholder_id": m.allow_placeholder_id,
            "dtype": m.dtype,
            "block_tokens": m.block_tokens,
            "bytes_per_block": cfg.replay.block_bytes,
        }
        cfg = load_config(data)
    return cfg


def _allow_placeholder(data: dict) -> None:
    model = data.get("model")
    if model is None:
        model = data["model"] = Config.model_fields["model"].default.model_dump(exclude_none=True)
    if isinstance(model, dict) and model.get("model_id", PLACEHOLDER_MODEL_ID) == PLACEHOLDER_MODEL_ID:
        data["model"] = {**model, "allow_placeholder_id": True}


def load_requests(cfg: Config, trace: str | os.PathLike[str] | None = None) -> list[Request]:
    """The trace (TraceError on a bad line) or the built-in chat workload, capped by replay.max_requests."""
    cap = cfg.replay.max_requests
    if trace is not None:
        requests = read_trace(trace, max_requests=cap)
    else:
        n = cfg.replay.num_requests if cap is None else min(cap, cfg.replay.num_requests)
        requests = chat_workload(n, seed=cfg.replay.seed, block_tokens=BLOCK_TOKENS)
    check_pacing(requests, cfg.replay.speed)
    return requests


MAX_PACED_S = 86_400.0  # a replay paced by its trace may wait at most a day in all


def check_pacing(requests: Sequence[Request], speed: float) -> None:
    """Refuse a ``speed`` at which the trace's timestamps would make the replay wait over a day."""
    if speed <= 0 or not requests:
        return
    t_first = requests[0].timestamp_ms
    span_s = max(r.timestamp_ms - t_first for r in requests) / 1000.0
    wait_s = span_s / speed
    if wait_s > MAX_PACED_S:
        raise ConfigError(
            f"replay.speed: {speed!r} would pace this trace's {span_s:.6g} s over {wait_s:.3g} s, more than "
            f"{MAX_PACED_S:.0f} s (one day); use speed >= {span_s / MAX_PACED_S:.3g}, or 0 for as fast as possible"
        )


def with_capacity_share(cfg: Config, requests: Sequence[Request], share: float) -> tuple[Config, TierSplit]:
    """``cfg`` with its tiers sized as ``share`` of the requests' unique blocks (see sizing.py).

    Capacities are exact multiples of bytes_per_block, so the tiers' slot counts
    (capacity // bytes_per_block) add up to the split's total. The config is validated
    again: the memory and disk-space checks still apply to the new sizes.
    """
    split = split_capacity(sim.unique_blocks(requests), longest_request(requests), share)
    bpb = cfg.bytes_per_block
    data = cfg.model_dump()
    data["gpu"]["num_blocks"] = split.gpu
    data["tiers"]["cpu"]["capacity"] = split.cpu * bpb
    data["tiers"]["disk"]["enabled"] = True
    data["tiers"]["disk"]["capacity"] = split.disk * bpb
    sized = validate_config(data, f"--capacity-share {share:g}")
    # The cache derives its slots this way (tier_slots over the layout): check they add up.
    layout = KVLayout.from_block_bytes(sized.model.region_block_bytes(), sized.gpu.num_blocks)
    slots = sized.gpu.num_blocks + sum(tier_slots(sized, layout).values())
    if slots != split.total:
        raise LayoutError(
            f"--capacity-share {share:g}: sized {split.total} blocks but the tiers hold {slots} slots "
            f"of {layout.bytes_per_block} bytes"
        )
    return sized, split


def with_disk_path(cfg: Config, path: str) -> Config:
    data = cfg.model_dump()
    data["tiers"]["disk"]["path"] = path
    return load_config(data)


# -- the replay ---------------------------------------------------------------------------
async def replay_async(
    cfg: Config,
    requests: Sequence[Request],
    *,
    on_done: Callable[[], None] | None = None,
    metrics_port: int | None = None,
    before_close: Callable[[EngineEmulator], Coroutine[Any, Any, None]] | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> ReplayResult:
    """Replay ``requests`` through a real cache; ``cfg.tiers.disk.path`` is used as given."""
    check_pacing(requests, cfg.replay.speed)
    cache = new_cache(cfg)
    server = None
    if metrics_port is not None:
        try:
            served = cache.metrics.serve(metrics_port)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {metrics_port}: cannot serve metrics on 127.0.0.1: {exc}"
            ) from exc
        server = served[0] if isinstance(served, tuple) else None
    engine: EngineEmulator | None = None
    try:
        async with cache:
            engine = new_emulator(cfg, cache, block_tokens)
            t0 = time.perf_counter()
            await run_requests(
                engine, requests, concurrency=cfg.replay.concurrency, speed=cfg.replay.speed, on_done=on_done
            )
            if before_close is not None:
                await before_close(engine)
            stats = cache.stats()
        wall = time.perf_counter() - t0  # includes draining the background spills at close
    finally:
        if engine is not None:
            engine.close()
        if server is not None:
            server.shutdown()
            server.server_close()
    return replay_result(cfg, engine, cache, stats, wall, block_tokens)


def replay_result(
    cfg: Config, engine: EngineEmulator, cache: TieredKVCache, stats: dict[str, Any], wall: float, block_tokens: int
) -> ReplayResult:
    """One cache's replay: its emulator's stats, its metrics after close and its capacities."""
    return ReplayResult(
        stats=engine.stats,
        metrics=cache.metrics.snapshot(),
        wall_s=wall,
        gpu_blocks=cfg.gpu.num_blocks,
        cpu_slots=stats["cpu"]["slots"],
        disk_slots=stats["disk"]["slots"] if "disk" in stats else 0,
        bytes_per_block=cache.layout.bytes_per_block,
        device=str(cache.layout.device),
        block_tokens=block_tokens,
        policy=cfg.eviction.policy,
        concurrency=cfg.replay.concurrency,
        hints=cfg.replay.hints,
        drop_partial=cfg.replay.drop_partial,
        remote=cfg.tiers.remote.enabled,
        slot_runs=dict(cache.metrics.runs_per_call),
        slot_run_blocks=cache.metrics.run_blocks,
    )


def run_replay(
    cfg: Config,
    requests: Sequence[Request],
    *,
    keep_disk: bool = False,
    on_done: Callable[[], None] | None = None,
    metrics_port: int | None = None,
    block_tokens: int = BLOCK_TOKENS,
) -> ReplayResult:
    """Replay on a fresh disk directory (removed afterwards) unless ``keep_disk``."""
    with fresh_disks(cfg, 1, keep_disk=keep_disk) as (cfg,):
        return run_loop(
            replay_async(cfg, requests, on_done=on_done, metrics_port=metrics_port, block_tokens=block_tokens)
        )


@contextmanager
def fresh_disks(cfg: Config, count: int, *, keep_disk: bool = False) -> Iterator[list[Config]]:
    """``count`` configs, each on its own fresh disk directory, removed on exit (unless ``keep_disk``).

    The directories are ``replay-<pid>`` (one) or ``replay-<pid>-<i>`` (a fleet) under
    ``tiers.disk.path``. Only what this run created is removed: those directories, and the
    configured directory (and its parents) only if they did not exist before.
    """
    if not cfg.tiers.disk.enabled or keep_disk:
        yield [cfg] * count
        return
    base = Path(cfg.tiers.disk.path)
    created = _missing_dirs(base)
    names = [f"replay-{os.getpid()}"] if count == 1 else [f"replay-{os.getpid()}-{i}" for i in range(count)]
    fresh = [base / name for name in names]
    try:
        for path in fresh:
            shutil.rmtree(path, ignore_errors=True)  # left by a killed run whose pid we now reuse
        yield [with_disk_path(cfg, str(path)) for path in fresh]
    finally:
        for path in fresh:
            shutil.rmtree(path, ignore_errors=True)
        for path in created:  # deepest first
            _remove_if_empty(path)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    probe = path.absolute()
    while not probe.exists() and probe.parent != probe:
        missing.append(probe)
        probe = probe.parent
    return missing


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()  # fails, as it should, when another run or the user put something there
    except OSError:
        pass


def simulate(
    requests: Sequence[Request], capacity_blocks: int, *, block_tokens: int = BLOCK_TOKENS
) -> dict[str, sim.SimResult]:
    """Single-tier yardsticks at ``capacity_blocks`` (the replay's gpu + cpu + disk slots).

    Flat LRU as is and with partial last blocks dropped, every registered eviction policy
    with them dropped, Belady both ways, and the unbounded cache.
    """
    drop = {"drop_partial": True, "block_tokens": block_tokens}
    out = {
        "lru": sim.simulate_lru(requests, capacity_blocks, block_tokens=block_tokens),
        "lru_drop_partial": sim.simulate_lru(requests, capacity_blocks, **drop),
    }
    for name in POLICIES:
        if name != "lru":
            out[f"{name}_drop_partial"] = sim.simulate_policy(requests, capacity_blocks, name, **drop)
    out["belady"] = sim.simulate_belady(requests, capacity_blocks, block_tokens=block_tokens)
    out["belady_drop_partial"] = sim.simulate_belady(requests, capacity_blocks, **drop)
    out["unbounded"] = sim.simulate_unbounded(requests)
    return out
