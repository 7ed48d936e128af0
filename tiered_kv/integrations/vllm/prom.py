"""The connector's counters on vLLM's own Prometheus endpoint (``/metrics`` of ``vllm serve``).

vLLM hands each interval's connector stats (stats.TieredKVStats: counter deltas) to ``observe``;
each known counter becomes ``vllm:tiered_kv_<name>_total`` with vLLM's per-engine labels. Names
outside KNOWN are ignored, so a new internal counter never creates an unbounded series.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

KNOWN = {
    "loaded_blocks": "Blocks loaded from tiered_kv into the engine's KV cache",
    "load_error_blocks": "Promised blocks that did not load (recomputed by vLLM)",
    "stored_blocks": "Blocks stored from the engine's KV cache into tiered_kv",
    "sync_loads": "CPU-tier hits served in the step they were found (synchronous loads)",
    "preemptions": "Preempted requests seen by the connector",
    "fenced_preemptions": "Preempted requests whose stores were still copying (fenced before the forward)",
    "released_blocks": "Blocks of ended sessions made the first to evict",
    "resets": "Connector resets (reset_prefix_cache with reset_connector)",
    "prompt_embeds_requests": "Requests with prompt embeddings (never stored or served)",
    "malformed_hints": "Requests whose kv_transfer_params.tiered_kv hint was malformed (ignored)",
    "unknown_hint_fields": "Unknown fields in kv_transfer_params.tiered_kv hints (ignored)",
}


class TieredKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in KNOWN.items():
            metric = self._counter_cls(name=f"vllm:tiered_kv_{name}", documentation=doc, labelnames=labelnames)
            self._counters[name] = {i: metric.labels(*vals) for i, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value > 0:
                per_engine[engine_idx].inc(value)
