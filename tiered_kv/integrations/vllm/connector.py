"""``TieredKVConnector``: a vLLM V1 KV connector backed by tiered_kv, in every topology vLLM runs.

vLLM builds one instance in the scheduler's process (role SCHEDULER) and one in
each worker (role WORKER); this class only dispatches to the half it is:
scheduler_half.SchedulerHalf owns the cache's state and answers residency,
worker_half.WorkerHalf copies its rank's shard of each job. They share a
shared-memory CPU tier and talk only through vLLM's per-step metadata
(scheduler -> workers) and worker metadata (workers -> scheduler). README, "Use
with vLLM", walks through a step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ...errors import ConfigError
from .meta import TieredKVMetadata
from .stats import StatsDelta, TieredKVStats, build_stats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid allocator on; every hook takes block ids per KV cache group."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss, not a lost hand-off

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # the workers' copiers are bound to the tensors registered at start; sleep mode remaps them

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        policy = getattr(ktc, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ConfigError(
                f"kv_transfer_config.kv_load_failure_policy is {policy!r}: TieredKVConnector needs 'recompute', "
                "so a block that fails to load (evicted, corrupt) is recomputed instead of failing the request"
            )
        extra = dict(ktc.kv_connector_extra_config or {})
        if "config" not in extra:
            raise ConfigError("kv_connector_extra_config.config: give a tiered_kv YAML path or an inline dict")
        self._stats_delta = StatsDelta()
        self._sched = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler_half import SchedulerHalf

            self._sched = SchedulerHalf(vllm_config, kv_cache_config, extra, str(ktc.engine_id))
        else:
            from .worker_half import WorkerHalf

            self._worker = WorkerHalf(vllm_config, kv_cache_config, extra, str(ktc.engine_id))

    # == worker side =========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self._worker.handshake() if self._worker is not None else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)  # a layered synchronous load (host); else waited in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are stored as jobs, issued in wait_for_save

    def wait_for_save(self) -> None:
        # After the target and draft forwards: issue the step's stores (never waited for: vLLM keeps their
        # blocks until they are reported, see request_finished).
        self._worker.save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A hybrid model's failed load is reported by request (vLLM 0.32 refuses its block ids); a
        # failed request is in finished_recving too, as vLLM wants.
        sending, recving = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=self._worker.failed_loads())  # fmt: skip

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.worker_meta() if self._worker is not None else None

    # == scheduler side ======================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._sched.on_handshake(metadata)

    def on_new_request(self, request: Any) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output) if self._sched is not None else TieredKVMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request), None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        return self._sched.request_finished(request), None  # True holds every group's blocks

    def register_finished_partial_tail(self, request: Any, block_ids: Any, partial_tail_offloads: Any) -> bool:
        return False  # vLLM 0.32 calls it only for Mamba 'align' tails, which are not stored (tails.py)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self._sched.loaded_group_ids() if self._sched is not None else ()

    def take_events(self) -> list[Any]:
        return self._sched.take_events() if self._sched is not None else []

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        tiers = {"cpu": CacheHitSource.HOST, "disk": CacheHitSource.DISK}
        split = self._sched.hit_sources(request.request_id, num_external_tokens) if self._sched is not None else {}
        out: dict[Any, int] = {}
        for tier, n in split.items():  # Redis and blocks still being stored have no vLLM tier of their own
            source = tiers.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + n
        return out

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:  # fmt: skip
        from .prom import TieredKVPromMetrics

        return TieredKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_block_frees(self) -> bool:
        return self._sched.has_pending_block_frees() if self._sched is not None else False

    def has_pending_push_work(self) -> bool:
        # Jobs resolve from the workers' reports, which travel only with a step: keep vLLM stepping
        # while any is in flight, so an idle engine still lands its last stores (and a reset can run).
        return self._sched.has_jobs_in_flight() if self._sched is not None else False

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        if self._sched is not None:
            self._sched.bind_vllm_cache(kv_cache_manager)

    def reset_cache(self) -> bool | None:
        return self._sched.reset() if self._sched is not None else None

    # == both ================================================================================
    def get_kv_connector_stats(self) -> TieredKVStats | None:
        return self._stats_delta.take(self._sched.counters) if self._sched is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TieredKVStats:
        return build_stats(data)

    def shutdown(self) -> None:
        for half in (self._sched, self._worker):
            if half is not None:
                half.close()
