"""What travels between the connector's halves each step (vLLM's executors serialise it between its own processes; tiered_kv never deserialises data read from disk or the network)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """Scheduler -> every worker, one per step (README, "Use with vLLM": the step protocol).

    ``load_jobs`` are issued in ``start_load_kv``; those in ``sync_loads`` feed this very step's forward
    (vLLM then calls start_load_kv before it), so the worker waits for them there. ``store_jobs`` are
    issued in ``wait_for_save``, after the target and draft forwards wrote the blocks they read.
    """

    load_jobs: list[Any] = field(default_factory=list)  # cross_process.ShardJob, in submission order
    store_jobs: list[Any] = field(default_factory=list)
    sync_loads: list[int] = field(default_factory=list)  # job ids of load_jobs this step's forward reads
    sync_load_errors: list[int] = field(default_factory=list)  # promised blocks no job loads: recompute them
    fence: list[int] = field(default_factory=list)  # store job ids of preempted requests: land before the forward
    loads_done: dict[str, list[int]] = field(default_factory=dict)  # async load over: req -> blocks not landed
    loads_failed: list[str] = field(default_factory=list)  # of loads_done: failed as a whole (failed_recving)
    stores_done: list[str] = field(default_factory=list)  # finished requests whose stores resolved: free them
    held: list[str] = field(default_factory=list)  # requests whose freeing waits for stores (request_finished)


@dataclass
class TieredKVWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per rank, the job ids its copier finished (ok, failed) since the last step."""

    reports: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {r: (list(ok), list(bad)) for r, (ok, bad) in self.reports.items()}
        for rank, (ok, bad) in getattr(other, "reports", {}).items():
            mine = merged.setdefault(rank, ([], []))
            mine[0].extend(ok)
            mine[1].extend(bad)
        return TieredKVWorkerMeta(merged)


@dataclass
class TieredKVHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once at start (vLLM collects it from every rank before the first step)."""

    rank: int
    bytes_per_block: int
    layout_spec: dict[str, Any]
    kv_replicas: int = 1  # TP ranks holding identical KV, stored once (replicas.py); checked against the scheduler's
