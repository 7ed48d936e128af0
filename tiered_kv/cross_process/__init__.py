"""The cache across processes: one scheduler process owns the cache's state, one worker per TP rank copies.

No serving engine here (vLLM's connector, integrations/vllm/, speaks its protocol over this package):

- ``scheduler_cache.open_scheduler_cache`` starts the scheduler's ``SchedulerCache``: a TieredKVCache
  over the shared CPU segment whose copy engine is a ``ProxyCopyEngine`` (proxy_engine.py): each copy
  becomes a ``ShardJob`` (shard_jobs.py) that every rank runs on its own shard;
- ``step_jobs`` starts cache calls so that every job they create is queued before a step's jobs are
  taken (a step's jobs ride in that step's metadata);
- ``shard_copier.ShardCopier`` copies one rank's shard of the jobs it is sent, on the worker;
- the segment's geometry (tiers/segment_geometry.py, read by both sides and by the CPU tier over the
  segment) is re-exported here.

This ``__init__`` is the package's interface: code outside it imports these names, never a module's
private ones.
"""

from ..tiers.segment_geometry import (
    SegmentInfo,
    group_layout,
    group_shard_id,
    segment_config,
    segment_info_for,
    storage_ranks,
)
from .layer_loads import LayeredLoad, LayerLoads, layer_groups
from .proxy_engine import ProxyCopyEngine, request_scope
from .scheduler_cache import SchedulerCache, open_scheduler_cache
from .shard_copier import ShardCopier
from .shard_jobs import LOAD, STORE, ShardJob
from .step_jobs import gather_loads, run_tagged, start_stores, start_sync_load, start_tagged

__all__ = [
    "LOAD",
    "STORE",
    "ProxyCopyEngine",
    "SchedulerCache",
    "SegmentInfo",
    "ShardCopier",
    "LayeredLoad",
    "LayerLoads",
    "layer_groups",
    "ShardJob",
    "gather_loads",
    "group_layout",
    "group_shard_id",
    "open_scheduler_cache",
    "request_scope",
    "run_tagged",
    "segment_config",
    "segment_info_for",
    "start_stores",
    "start_sync_load",
    "start_tagged",
    "storage_ranks",
]
