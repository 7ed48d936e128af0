"""Prometheus counters per tier and direction, one registry per cache.

Hit rates are derived from counters (hits / lookups), never stored as gauges.
A frontend serves ``cache.metrics.registry`` with its own HTTP stack, or calls
``serve(port)``.
"""

from __future__ import annotations

import logging

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily

from .core import core
from .media import MOVES, Medium

log = logging.getLogger("tiered_kv")

TIERS = tuple(m.value for m in Medium if m is not Medium.GPU)  # ("cpu", "disk", "remote")
DIRECTIONS = tuple(route.name for route in MOVES)  # ("gpu_to_cpu", "cpu_to_gpu", ...)
# The remote tier's own per-operation results (the store counts them; the dispatcher counts directions).
REMOTE_RESULTS = {"put": ("stored", "failed"), "get": ("hit", "miss", "corrupt", "failed"),
                  "exists": ("present", "absent", "failed")}
# Runs of consecutive CPU slots per store plan: one copy (memcpy / DMA descriptor) per run.
_RUN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookups = Counter("tiered_kv_lookup_blocks", "Blocks asked for by lookup", registry=r)
        self.hits = Counter("tiered_kv_hit_blocks", "Leading blocks found by lookup", ["tier"], registry=r)
        self.bytes = Counter("tiered_kv_bytes", "Bytes moved", ["direction"], registry=r)
        self.blocks = Counter("tiered_kv_blocks_moved", "Blocks moved", ["direction"], registry=r)
        self.seconds = Counter("tiered_kv_transfer_seconds", "Wall time of copies", ["direction"], registry=r)
        self.evictions = Counter("tiered_kv_evictions", "Blocks evicted", ["tier"], registry=r)
        self.spills = Counter("tiered_kv_spills", "Blocks written from CPU to disk", registry=r)
        self.skipped = Counter("tiered_kv_store_skipped", "Blocks a store could not place", registry=r)
        self.corrupt = Counter("tiered_kv_corrupt_blocks", "Blocks dropped on a failed check", ["tier"], registry=r)
        self.dropped = Counter(
            "tiered_kv_dropped_blocks", "Blocks the cache gave up on because of an error", ["tier", "cause"], registry=r
        )
        self.degraded = Counter("tiered_kv_degraded_events", "Tier faults that disabled writes", ["tier"], registry=r)
        self.inflight_bytes = Gauge("tiered_kv_inflight_bytes", "Bytes of copies in flight", registry=r)
        self.used_slots = Gauge("tiered_kv_used_slots", "Slots holding or receiving a block", ["tier"], registry=r)
        self.remote_blocks = Counter(
            "tiered_kv_remote_blocks", "Remote tier blocks per operation and result", ["op", "result"], registry=r
        )
        self.remote_bytes = Counter("tiered_kv_remote_bytes", "Bytes of verified remote values moved", ["op"], registry=r)
        self.remote_seconds = Counter("tiered_kv_remote_seconds", "Wall time of remote batches", ["op"], registry=r)
        for op, results in REMOTE_RESULTS.items():
            for result in results:
                self.remote_blocks.labels(op, result)
            if op != "exists":
                self.remote_bytes.labels(op)
                self.remote_seconds.labels(op)
        self.latency = Histogram(
            "tiered_kv_op_seconds", "load/store latency", ["op"], buckets=_LATENCY_BUCKETS, registry=r
        )
        # Label children resolved once: .labels() costs more than the increment on the hot path,
        # and creating them up front exports every series from the start.
        self.hit = {t: self.hits.labels(t) for t in TIERS}
        self.evicted = {t: self.evictions.labels(t) for t in TIERS}
        self.corrupted = {t: self.corrupt.labels(t) for t in TIERS}
        self.degrade = {t: self.degraded.labels(t) for t in TIERS}
        self._moved = {
            d: (self.blocks.labels(d), self.bytes.labels(d), self.seconds.labels(d)) for d in DIRECTIONS
        }
        self.op_latency = {op: self.latency.labels(op) for op in ("load", "store")}
        self.runs_per_call: dict[int, int] = {}  # runs -> store plans with that many (exact, for reports)
        self.run_blocks = 0  # the slots of those plans
        r.register(_SlotRunsHistogram(self.runs_per_call))  # tiered_kv_store_slot_runs, built from it at scrape
        self._drop_causes_logged: set[tuple[str, str]] = set()

    def track_used_slots(self, tier: str, used) -> None:
        """Read the slot count at scrape time instead of updating a gauge on every move."""
        self.used_slots.labels(tier).set_function(used)

    def manager_event(self, kind: str, tier: str, n: int) -> None:
        """A tier manager's event (manager.EVENT_KINDS) of ``n`` blocks, as it counts here."""
        if kind == "evicted":
            self.evicted[tier].inc(n)
        elif kind == "dropped" and tier == "cpu":  # disk drops are counted where their error is seen
            self.drop("cpu", "no_disk_room", n)

    def drop(self, tier: str, cause: str, n: int = 1, detail: str = "") -> None:
        """Count blocks dropped because of an error; log at WARNING once per (tier, cause)."""
        if n <= 0:
            return
        self.dropped.labels(tier, cause).inc(n)
        if (tier, cause) not in self._drop_causes_logged:
            self._drop_causes_logged.add((tier, cause))
            log.warning(
                "tiered_kv %s tier dropped %d block(s): %s%s (logged once per cause; see tiered_kv_dropped_blocks)",
                tier, n, cause, f" ({detail})" if detail else "",
            )

    def moved(self, direction: str, nblocks: int, nbytes: int, seconds: float) -> None:
        blocks, nbytes_c, secs = self._moved[direction]
        blocks.inc(nblocks)
        nbytes_c.inc(nbytes)
        secs.inc(seconds)

    def store_slots(self, slots: np.ndarray) -> None:
        """A store plan's CPU slots (any order): count its runs of consecutive slots."""
        if not len(slots):
            return
        n = slot_runs(slots)
        self.runs_per_call[n] = self.runs_per_call.get(n, 0) + 1
        self.run_blocks += len(slots)

    def snapshot(self) -> dict[str, float]:
        """Flat ``name{label}`` -> value, read from the registry (for stats() and reports)."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket")):
                    continue
                label = ",".join(sample.labels.values())
                out[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
        return out

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Expose /metrics on ``addr:port``; returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)


def slot_runs(slots: np.ndarray) -> int:
    """How many runs of consecutive slots ``slots`` (distinct, any order) form: 0 for none (native: a tenth
    of numpy's sort and compare on a 64-slot plan)."""
    return core.slot_runs(slots)


class _SlotRunsHistogram:
    """``tiered_kv_store_slot_runs`` as a Prometheus histogram, read from the exact counts a store already keeps
    (runs -> plans) when scraped: a store pays one dict update, not a second record of the same count."""

    def __init__(self, counts: dict[int, int]) -> None:
        self._counts = counts

    def describe(self):
        return [HistogramMetricFamily("tiered_kv_store_slot_runs", "Runs of consecutive CPU slots per store plan")]

    def collect(self):
        counts = dict(self._counts)  # one C-level copy: a store on another thread may add a key meanwhile
        buckets = [(str(float(b)), sum(n for runs, n in counts.items() if runs <= b)) for b in _RUN_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))  # cumulative, as Prometheus buckets are
        total = float(sum(runs * n for runs, n in counts.items()))
        yield HistogramMetricFamily("tiered_kv_store_slot_runs", "Runs of consecutive CPU slots per store plan",
                                    buckets=buckets, sum_value=total)  # fmt: skip


def runs_summary(counts: dict[int, int], blocks: int = 0) -> dict[str, float | int | None]:
    """Store plans, mean / p90 / max runs per plan and mean blocks per plan, from ``runs -> plans`` counts
    and the plans' blocks (CacheMetrics.runs_per_call, run_blocks)."""
    calls = sum(counts.values())
    if not calls:
        return {"calls": 0, "mean": None, "p90": None, "max": None, "blocks_mean": None}
    at, seen, p90 = max(1, -(-9 * calls // 10)), 0, 0  # the ceil(0.9 n)-th smallest
    for runs in sorted(counts):
        seen += counts[runs]
        if seen >= at:
            p90 = runs
            break
    mean = sum(r * c for r, c in counts.items()) / calls
    return {"calls": calls, "mean": mean, "p90": p90, "max": max(counts), "blocks_mean": blocks / calls}
