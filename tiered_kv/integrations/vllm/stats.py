"""The connector's counters as vLLM connector stats (logged with vLLM's KV transfer metrics)."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class TieredKVStats(KVConnectorStats):
    """Block counts over one interval: loaded_blocks, load_error_blocks, stored_blocks."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """What a counter gained since the last call: vLLM sums the intervals it receives."""

    def __init__(self) -> None:
        self._last: Counter[str] = Counter()

    def take(self, counters: Counter[str]) -> TieredKVStats | None:
        # The loop thread adds keys while vLLM's thread asks: dict.copy is one C call under the GIL, where
        # iterating the live Counter could raise "dictionary changed size during iteration".
        now = dict.copy(counters)
        delta = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = Counter(now)
        return TieredKVStats(data=delta) if delta else None


def build_stats(data: dict[str, Any] | None) -> TieredKVStats:
    return TieredKVStats(data=dict(data or {}))


class StatsFile:
    """``stats_file``: the counters and the cache's stats as JSON, rewritten whenever the counters moved
    (vLLM may kill the EngineCore at shutdown before the connector closes, so it cannot wait for close)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._written: Counter[str] | None = None  # the counters the file last showed
        self._lock = threading.Lock()  # the scheduler thread and a session release may both write

    def write(self, counters: Counter[str], report: Callable[[], dict[str, Any]], force: bool = False) -> None:
        with self._lock:
            if not self.path or (not force and counters == self._written):
                return
            self._written = Counter(counters)
            try:
                tmp = Path(f"{self.path}.tmp")
                tmp.write_text(json.dumps(report(), default=str))
                tmp.replace(self.path)
            except Exception:  # a report is not worth failing a step for
                logging.getLogger(__name__).exception("tiered_kv: writing stats to %s failed", self.path)
