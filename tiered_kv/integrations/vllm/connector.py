"""``TieredKVConnector``: a vLLM V1 KV connector backed by tiered_kv.

Scheduler side: ``get_num_new_matched_tokens`` answers from the worker cache's
residency, in whole blocks, leaving at least one prompt token to compute (vLLM
needs its logits). ``build_connector_meta`` sends the worker two lists per
step: blocks to load (hits promised this step) and newly computed full prompt
blocks to store. Worker side: loads run at ``start_load_kv`` and stores at
``wait_for_save``, both finished before the call returns, so no copy outlives
the blocks vLLM lent us. A load that lands fewer blocks than promised (evicted
since the lookup, corrupt on disk, an I/O error) reports the rest through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"``
vLLM recomputes them. Stores of a request whose load failed this step are
skipped, since those blocks were computed over bad prefix KV.

Residency: the scheduler asks the worker's cache in the same process (vLLM's
in-process executor with one worker). If no cache lives in the scheduler's
process (a multi-process executor), it reports no hits and logs that once;
stores still happen on every worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ...errors import ConfigError
from ...layout import KVLayout
from .keys import request_block_keys, salt_of
from .runtime import CacheRuntime, find_runtime, publish_runtime, resolve_config
from .stats import StatsDelta, TieredKVStats, build_stats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class BlockTransfer:
    """Blocks [start, end) of one request: the tokens that key them and vLLM's block ids for them."""

    req_id: str
    token_ids: list[int]  # the prompt up to block ``end``
    salt: tuple[int, ...]
    start: int
    block_ids: list[int]


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    stores: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Req:
    prompt: list[int]
    salt: tuple[int, ...]
    block_ids: list[int]
    next_store: int  # first block not yet stored or known resident


class TieredKVConnector(KVConnectorBase_V1):
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss, not a lost hand-off

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False  # the cache is bound to the tensors registered at start; sleep mode remaps them

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        policy = getattr(ktc, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ConfigError(
                f"kv_transfer_config.kv_load_failure_policy is {policy!r}: TieredKVConnector needs 'recompute', "
                "so a block that fails to load (evicted, corrupt) is recomputed instead of failing the request"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ConfigError(f"TieredKVConnector supports one KV cache group; this model has {len(groups)}")
        self._block_size: int = vllm_config.cache_config.block_size
        self._engine_key = str(ktc.engine_id)
        self._extra = dict(ktc.kv_connector_extra_config or {})
        if "config" not in self._extra:
            raise ConfigError("kv_connector_extra_config.config: give a tiered_kv YAML path or an inline dict")
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._salts: dict[str, tuple[int, ...]] = {}
        self._asked: dict[str, int] = {}
        self._pending_loads: dict[str, tuple[int, int, list[int]]] = {}
        self._warned_no_runtime = False
        # worker side
        self._runtime: CacheRuntime | None = None
        self._load_errors: set[int] = set()
        self._stats_delta = StatsDelta()
        self._failed_reqs: set[str] = set()  # requests whose load failed this step: their stores are skipped

    # == worker side =========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kcc = self._kv_cache_config
        # The scheduler's logical size of each backing allocation, named by one of its layers:
        # never the tensors' (possibly padded) storage size.
        sizes: dict[str, int] = {}
        for t in kcc.kv_cache_tensors:
            layers = getattr(t, "layers", None) or getattr(t, "shared_by", None) or []
            name = next((n for n in layers if n in kv_caches), None)
            if name is not None:
                sizes[name] = int(t.size)
        layout = KVLayout.from_tensors(kv_caches, kcc.num_blocks, sizes or None, block_tokens=self._block_size)
        mc = self._vllm_config.model_config
        cfg = resolve_config(
            self._extra["config"], str(mc.model), getattr(mc, "revision", None), layout.bytes_per_block
        )
        rank, world = _tp_rank()
        runtime = CacheRuntime(cfg, layout, rank=rank, world_size=world)
        runtime.stats_file = self._extra.get("stats_file")
        publish_runtime(self._engine_key, runtime)
        self._runtime = runtime
        log.info("tiered_kv: %d KV regions, %d bytes per block, %d blocks; %s", layout.num_regions,
                 layout.bytes_per_block, layout.num_blocks, runtime.stats()["cpu"])  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        rt = self._runtime
        if rt is None or not isinstance(meta, TieredKVMetadata):
            return
        self._failed_reqs = set()
        compute = _compute_event(rt) if meta.loads else None
        for t in meta.loads:
            n = 0
            try:
                keys = _chain(rt, t, self._block_size)[t.start :]
                n = rt.load(keys, t.block_ids, compute=compute)
            except Exception as exc:  # never crash the engine: vLLM recomputes what we did not load
                log.warning("tiered_kv: load of %d blocks for %s failed: %r", len(t.block_ids), t.req_id, exc)
            rt.counters["loaded_blocks"] += n
            if n < len(t.block_ids):
                self._load_errors.update(t.block_ids[n:])
                self._failed_reqs.add(t.req_id)
                rt.counters["load_error_blocks"] += len(t.block_ids) - n

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are stored once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        rt = self._runtime
        if rt is None or not isinstance(meta, TieredKVMetadata):
            return
        compute = _compute_event(rt) if meta.stores else None
        for t in meta.stores:
            if t.req_id in self._failed_reqs:
                continue
            try:
                keys = _chain(rt, t, self._block_size)
                # The chain before this chunk is the prefix: it is never evicted for the chunk,
                # and the whole chain is touched head first (no orphaned blocks).
                res = rt.store(keys[t.start :], t.block_ids, prefix=keys[: t.start], compute=compute)
                rt.counters["stored_blocks"] += getattr(res, "stored", 0)
            except Exception as exc:  # a lost store is a future miss, never an engine failure
                log.warning("tiered_kv: store of %d blocks for %s failed: %r", len(t.block_ids), t.req_id, exc)
        self._failed_reqs = set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> TieredKVStats | None:
        return self._stats_delta.take(self._runtime.counters) if self._runtime is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TieredKVStats:
        return build_stats(data)

    def shutdown(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    # == scheduler side ======================================================================
    def on_new_request(self, request: Any) -> None:
        self._salts[request.request_id] = salt_of(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rt = find_runtime(self._engine_key)
        if rt is None:
            if not self._warned_no_runtime:
                self._warned_no_runtime = True
                log.warning("tiered_kv: no worker cache in the scheduler's process; reporting no hits "
                            "(use the in-process executor with one worker)")  # fmt: skip
            return 0, False
        bs = self._block_size
        prompt = request.prompt_token_ids or []
        max_blocks = (len(prompt) - 1) // bs  # vLLM computes at least the last prompt token
        if max_blocks * bs <= num_computed_tokens:
            return 0, False
        salt = self._salts.setdefault(request.request_id, salt_of(request))
        try:
            hit = rt.lookup(request_block_keys(rt.keyer, prompt, bs, salt, max_blocks))
        except Exception as exc:
            log.warning("tiered_kv: lookup for %s failed, treating it as a miss: %r", request.request_id, exc)
            return 0, False
        self._asked[request.request_id] = num_computed_tokens
        return max(0, hit * bs - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        bs = self._block_size
        start = self._asked.get(request.request_id, 0) // bs
        end = start + num_external_tokens // bs
        block_ids = list(blocks.get_block_ids()[0])
        self._pending_loads[request.request_id] = (start, end, block_ids[start:end])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = TieredKVMetadata()
        bs = self._block_size
        for new in scheduler_output.scheduled_new_reqs:
            rid = new.req_id
            req = _Req(list(new.prompt_token_ids or []), self._salts.get(rid, ()), list(new.block_ids[0]), 0)
            self._reqs[rid] = req
            load = self._pending_loads.pop(rid, None)
            if load is not None:
                start, end, ids = load
                meta.loads.append(BlockTransfer(rid, req.prompt[: end * bs], req.salt, start, ids))
                req.next_store = end  # resident already
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(rid, 0)
            self._queue_store(meta, rid, req, done)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            req = self._reqs.get(rid)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                req.block_ids = list(new_ids[0]) if rid in resumed else req.block_ids + list(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(rid, 0)
            self._queue_store(meta, rid, req, done)
        for rid in scheduler_output.finished_req_ids:
            self._forget(rid)
        self._asked.clear()
        return meta

    def _queue_store(self, meta: TieredKVMetadata, rid: str, req: _Req, done_tokens: int) -> None:
        bs = self._block_size
        end = min(done_tokens, len(req.prompt), len(req.block_ids) * bs) // bs
        if end > req.next_store:
            ids = req.block_ids[req.next_store : end]
            meta.stores.append(BlockTransfer(rid, req.prompt[: end * bs], req.salt, req.next_store, ids))
            req.next_store = end

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # stores are done by the time a step returns: the blocks are free to go

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._salts.pop(rid, None)
        self._pending_loads.pop(rid, None)


def _chain(rt: CacheRuntime, t: BlockTransfer, block_size: int) -> list[bytes]:
    """Keys of the request's blocks up to the end of this transfer (``[t.start:]`` are its own)."""
    end = t.start + len(t.block_ids)
    return request_block_keys(rt.keyer, t.token_ids, block_size, t.salt, end)[:end]


def _compute_event(rt: CacheRuntime) -> Any:
    """An event on the model's current stream, recorded here in vLLM's thread; None for CPU tensors.

    The cache's loop thread has a current stream of its own (the default stream), which
    vLLM's compute stream does not wait on: ordering must be captured on this thread.
    """
    device = rt.cache.layout.device
    if device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _tp_rank() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # parallel state not initialised (single process): one shard
        return 0, 1
