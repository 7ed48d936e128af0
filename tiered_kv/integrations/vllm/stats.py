"""The connector's counters as vLLM connector stats (logged with vLLM's KV transfer metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
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
