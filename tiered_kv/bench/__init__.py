"""`tiered-kv bench`: every figure a ratio against the raw operation, measured side by side in one run.

Sections: ``cache`` (store/load through TieredKVCache vs the fastest raw copy),
``disk`` (spill/promote through the cache vs pwritev/preadv), ``lookup`` (vs a
dict loop), ``memory`` (bytes per resident block), ``host`` (host time per
call by copy path), ``inflight`` (1 and N calls in flight, both ways at once,
the host time split into the engine's and the cache's), ``call_cost`` (the
cache's own cost per call over a counted engine) and ``gpu`` (the cache and
inflight sections on CUDA). The method (interleaved rounds, medians with their spread,
a flag when the raw reference is the slower side) is in ``stats``.
"""

from .run import SECTIONS, TARGETS, run_bench, run_bench_cli

__all__ = ["SECTIONS", "TARGETS", "run_bench", "run_bench_cli"]
