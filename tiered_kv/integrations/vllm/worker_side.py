"""The connector's worker half: copy this rank's shard of each job, report, never wait for a store.

Each rank opens the shared CPU segment at start (computed from its own numbers:
whoever opens second checks the first one's), issues the step's jobs on its copier at ``start_load_kv`` and returns at once;
the jobs the copier finished go back in the next ``build_connector_worker_meta``.
The scheduler tells every rank when a request's load or stores are over, and
each rank reports it (``finished_recving`` / ``finished_sending``), which vLLM
counts to world_size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...split.worker import ShardCopier
from ...tiers.segment_geometry import segment_config, segment_info_for
from .geometry import worker_layout
from .meta import TieredKVHandshake, TieredKVMetadata, TieredKVWorkerMeta

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 60.0  # a preemption fence that takes longer is a fault: the copier reports those jobs failed


class WorkerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any], engine_id: str) -> None:
        self._engine_id = engine_id
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._extra = extra
        self._rank, self._world = _tp_rank()
        self._copier: ShardCopier | None = None
        self._handshake: TieredKVHandshake | None = None
        self._meta: TieredKVMetadata | None = None
        self._ok: list[int] = []
        self._failed: list[int] = []
        self._finished_seen: set[str] = set()  # finished_req_ids vLLM passed to get_finished so far
        self._to_release: set[str] = set()  # finished requests the scheduler said are free to go

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kcc = self._kv_cache_config
        layout = worker_layout(kv_caches, kcc, self._vllm_config.cache_config.block_size)
        # The segment's geometry from one pure module (tiers/segment_geometry.py), and only the config
        # sections it needs: the scheduler computes the same from its own numbers.
        cfg = segment_config(self._extra["config"], group_bytes_per_block=layout.bytes_per_block * self._world)
        copier = ShardCopier(layout, rank=self._rank, world_size=self._world, engine=cfg.transfer.engine,
                             pin_chunk=cfg.tiers.cpu.pin_chunk)  # fmt: skip
        try:  # create-or-attach: whoever opens second checks the first one's numbers (LayoutError names both)
            copier.open(segment_info_for(cfg, layout, world_size=self._world, engine_id=self._engine_id))
        except BaseException:
            copier.close()
            raise
        self._copier = copier
        self._handshake = TieredKVHandshake(self._rank, layout.bytes_per_block, layout.spec())
        log.info("tiered_kv: TP rank %d/%d, %d KV regions, %d bytes per block per rank, %d blocks", self._rank,
                 self._world, layout.num_regions, layout.bytes_per_block, layout.num_blocks)  # fmt: skip

    def handshake(self) -> TieredKVHandshake | None:
        return self._handshake

    def handle_preemptions(self, meta: Any) -> None:
        if self._copier is None or not isinstance(meta, TieredKVMetadata) or not meta.flush:
            return
        ok, failed = self._copier.drain(FLUSH_TIMEOUT_S)  # freed blocks are reused by this very step
        self._ok += ok
        self._failed += failed

    def start(self, meta: Any) -> None:
        self._meta = meta if isinstance(meta, TieredKVMetadata) else None
        if self._copier is None or self._meta is None:
            return
        if meta.jobs:
            self._copier.submit(meta.jobs)
        self._to_release.update(meta.stores_done)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._finished_seen |= finished_req_ids
        sending = self._to_release & self._finished_seen  # vLLM only frees what it told us had finished
        self._to_release -= sending
        self._finished_seen -= sending
        recving = set(self._meta.loads_done) if self._meta is not None else set()
        return sending, recving

    def load_errors(self) -> set[int]:
        if self._meta is None:
            return set()
        errors = {b for ids in self._meta.loads_done.values() for b in ids}
        return errors

    def worker_meta(self) -> TieredKVWorkerMeta | None:
        if self._copier is not None:
            ok, failed = self._copier.poll()
            self._ok += ok
            self._failed += failed
        self._meta = None
        if not self._ok and not self._failed:
            return None
        report = TieredKVWorkerMeta({self._rank: (self._ok, self._failed)})
        self._ok, self._failed = [], []
        return report

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
            self._copier = None


def _tp_rank() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # parallel state not initialised (single process): one shard
        return 0, 1
