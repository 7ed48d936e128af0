"""The scheduler/worker split: the cache's state in the scheduler, copies on each TP rank's worker.

``scheduler.open_scheduler_cache`` builds the scheduler side (a TieredKVCache over the shared CPU
segment and a ProxyCopyEngine); ``worker.ShardCopier`` copies one rank's shard of the jobs it is sent.
"""

from .jobs import LOAD, STORE, ShardJob
from .proxy import ProxyCopyEngine, request_scope

__all__ = ["LOAD", "STORE", "ProxyCopyEngine", "ShardJob", "request_scope"]
