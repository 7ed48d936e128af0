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
    """Scheduler -> every worker, one per step."""

    jobs: list[Any] = field(default_factory=list)  # split.jobs.ShardJob, in submission order
    flush: bool = False  # a preempted request's blocks may be reused this step: land issued copies first
    loads_done: dict[str, list[int]] = field(default_factory=dict)  # req -> its blocks the load did not land
    stores_done: list[str] = field(default_factory=list)  # finished requests whose stores resolved: free them


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
