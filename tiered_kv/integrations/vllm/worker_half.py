"""The connector's worker half: copy this rank's shard of each job, in the step vLLM's protocol puts it.

Each rank opens the shared CPU segment at start (computed from its own numbers: whoever opens second
checks the first one's). Per step (README, "Use with vLLM"):

- ``handle_preemptions``: wait for the stores of requests preempted this step that are still copying
  (their GPU blocks are reused by this step's forward); one that outlives the fence is reported failed,
  so its store is discarded, never committed.
- ``start_load_kv``: issue the step's loads; a synchronous load (a CPU hit served in the step it was
  found) is waited for here, before the forward reads it (vLLM calls start_load_kv before the forward
  whenever a step has one). A rank whose copy failed reports the blocks in get_block_ids_with_load_errors
  in the same step, and vLLM recomputes them. On a host rank with several layer tensors the synchronous
  loads are copied layer by layer (cross_process/layer_loads.py): only the last block of each, which the
  forward may also write, is waited for here, and ``wait_for_layer_load`` waits for each layer's rows.
- ``wait_for_save``: issue the step's stores, after the target and draft forwards wrote their blocks (on
  CUDA the ordering event is recorded here, on the forward's stream).
- ``build_connector_worker_meta``: the job ids this rank finished since the last step.

Every copy starts on this thread (the model runner's): the ShardCopier has no thread or loop of its own,
``poll`` reads its engine's completion counters and a ``wait`` sleeps with the GIL released.

The scheduler tells every rank when a request's async load or its stores are over, and each rank
reports it (``finished_recving`` / ``finished_sending``), which vLLM counts to world_size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...cross_process import ShardCopier, layer_groups, segment_config, segment_info_for, storage_ranks
from ...errors import TransferError
from .block_bytes import worker_layout
from .meta import TieredKVHandshake, TieredKVMetadata, TieredKVWorkerMeta
from .replicas import kv_tp_replicas

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FENCE_TIMEOUT_S = 30.0  # a preempted request's store still copying after this is reported failed (discarded)
LOAD_WAIT_S = 30.0  # a synchronous load is waited for to the end (its copy writes the forward's blocks); logged


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
        self._tainted: set[int] = set()  # jobs that outlived a fence: reported failed whenever they finish
        self._errors: set[int] = set()  # this step's blocks whose synchronous load did not land
        self._layers = False  # synchronous loads copied layer by layer (host engine: cross_process/layer_loads.py)
        self._layered: Any = None  # this step's layered load, waited per layer by wait_for_layer_load
        # Requests whose freeing waits for their stores (request_finished said True): only these are
        # remembered from vLLM's finished_req_ids, so the sets stay as small as what is in flight.
        self._held: set[str] = set()
        self._finished_seen: set[str] = set()  # held requests vLLM has told us finished
        self._to_release: set[str] = set()  # held requests the scheduler said are free to go

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kcc = self._kv_cache_config
        layout = worker_layout(kv_caches, kcc, self._vllm_config.cache_config.block_size)
        # The segment's geometry from one pure module (cross_process's segment_*), and only the config
        # sections it needs: the scheduler computes the same from its own numbers. Replicated KV (MLA)
        # is stored once per replica set (replicas.py).
        replicas = kv_tp_replicas(self._vllm_config, kcc, self._world)
        stored_bytes = layout.bytes_per_block * storage_ranks(self._world, replicas)
        cfg = segment_config(self._extra["config"], group_bytes_per_block=stored_bytes)
        copier = ShardCopier(layout, rank=self._rank, world_size=self._world, engine=cfg.transfer.engine,
                             pin_chunk=cfg.tiers.cpu.pin_chunk, kv_replicas=replicas)  # fmt: skip
        try:  # create-or-attach: whoever opens second checks the first one's numbers (LayoutError names both)
            copier.open(segment_info_for(cfg, layout, world_size=self._world, engine_id=self._engine_id,
                                         kv_replicas=replicas))  # fmt: skip
        except BaseException:
            copier.close()
            raise
        self._copier = copier
        if len(getattr(kcc, "kv_cache_groups", ())) <= 1 and all(_dense(t) for t in kv_caches.values()):
            self._layers = copier.enable_layers(layer_groups(kv_caches, layout.regions))
        self._handshake = TieredKVHandshake(self._rank, layout.bytes_per_block, layout.spec(), replicas)
        log.info("tiered_kv: TP rank %d/%d, %d KV regions, %d bytes per block per rank, %d blocks", self._rank,
                 self._world, layout.num_regions, layout.bytes_per_block, layout.num_blocks)  # fmt: skip

    def handshake(self) -> TieredKVHandshake | None:
        return self._handshake

    def handle_preemptions(self, meta: Any) -> None:
        if self._copier is None or not isinstance(meta, TieredKVMetadata) or not meta.fence:
            return
        try:  # the preempted requests' blocks are reused by this very step: no store may read them after
            self._copier.wait(meta.fence, FENCE_TIMEOUT_S)
        except TransferError as exc:
            log.error("tiered_kv rank %d: %s; those stores will be discarded", self._rank, exc)
            self._tainted.update(meta.fence)

    def start(self, meta: Any) -> None:
        """start_load_kv: issue the step's loads; wait for the synchronous ones."""
        self._meta = meta if isinstance(meta, TieredKVMetadata) else None
        self._errors = set()
        if self._copier is None or self._meta is None:
            return
        self._errors.update(meta.sync_load_errors)
        self._held.update(meta.held)
        self._to_release.update(meta.stores_done)
        sync = set(meta.sync_loads)
        if self._layers and sync:  # copied layer by layer: wait_for_layer_load waits for each
            self._copier.submit([j for j in meta.load_jobs if j.job_id not in sync])
            self._layered = self._copier.submit_layered([j for j in meta.load_jobs if j.job_id in sync])
            self._layered.wait_edges(LOAD_WAIT_S)  # the blocks the forward may write have landed
            return
        if meta.load_jobs:
            self._copier.submit(meta.load_jobs)
        if meta.sync_loads:
            self._wait_loads(meta)

    def wait_layer(self, layer_name: str) -> None:
        """wait_for_layer_load: this layer's rows of the step's synchronous loads have landed."""
        if self._layered is not None:
            self._layered.wait_layer(layer_name, LOAD_WAIT_S)

    def _land_layered(self) -> None:
        """The whole layered load has landed (before stores and reports): its outcome, as _wait_loads."""
        if self._layered is None or self._meta is None:
            return
        self._layered = None
        self._wait_loads(self._meta)

    def _wait_loads(self, meta: TieredKVMetadata) -> None:
        ids = set(meta.sync_loads)
        while True:  # the copies write blocks this step's forward reads: never return before they landed
            try:
                self._copier.wait(ids, LOAD_WAIT_S)
                break
            except TransferError as exc:
                log.warning("tiered_kv rank %d: a synchronous load is slow: %s", self._rank, exc)
        ok, failed = self._copier.poll()
        self._ok += ok
        self._failed += failed
        bad = set(failed) & ids
        if bad:
            for job in meta.load_jobs:
                if job.job_id in bad:
                    self._errors.update(int(b) for b in job.gpu_ids)

    def save(self) -> None:
        """wait_for_save: the step's forwards have written their blocks; issue the stores that read them."""
        self._land_layered()
        meta = self._meta
        if self._copier is not None and meta is not None and meta.store_jobs:
            self._copier.submit(meta.store_jobs)  # a rank that writes no copy acknowledges them (ShardCopier)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._land_layered()
        self._finished_seen |= finished_req_ids & self._held
        sending = self._to_release & self._finished_seen  # vLLM only frees what it told us had finished
        self._to_release -= sending
        self._finished_seen -= sending
        self._held -= sending
        recving = set(self._meta.loads_done) if self._meta is not None else set()
        return sending, recving

    def failed_loads(self) -> set[str]:
        """Requests whose async load failed as a whole (a hybrid model's): vLLM recomputes them."""
        return set(self._meta.loads_failed) if self._meta is not None else set()

    def load_errors(self) -> set[int]:
        self._land_layered()
        errors = set(self._errors)
        if self._meta is not None:
            errors.update(b for ids in self._meta.loads_done.values() for b in ids)
        return errors

    def worker_meta(self) -> TieredKVWorkerMeta | None:
        self._land_layered()
        if self._copier is not None:
            ok, failed = self._copier.poll()
            self._ok += ok
            self._failed += failed
        self._meta = None
        if not self._ok and not self._failed:
            return None
        ok, failed = self._ok, self._failed
        if self._tainted:
            late = [j for j in ok if j in self._tainted]
            if late:
                ok = [j for j in ok if j not in self._tainted]
                failed = failed + late
            self._tainted.difference_update(late)
            self._tainted.difference_update(failed)
        report = TieredKVWorkerMeta({self._rank: (ok, failed)})
        self._ok, self._failed = [], []
        return report

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
            self._copier = None


def _dense(t: Any) -> bool:
    return hasattr(t, "is_contiguous") and t.is_contiguous()


def _tp_rank() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # parallel state not initialised (single process): one shard
        return 0, 1
