"""The trace-replay harness: workloads, simulators and an engine emulator over a real TieredKVCache.

Submodules are imported on use: ``trace``/``workload``/``simulate`` are light,
``engine``/``run`` pull in torch and the cache.
"""
