"""Memory per resident block: the tier manager holding N blocks, keys included.

The CPU tier's index is built and filled through the manager's own store path
(prepare_store -> complete_store, bookkeeping only: no bytes move), in batches
of FILL_BATCH: what a block keeps does not depend on the batch it came in. tracemalloc sees both the numpy arrays (numpy reports them in its
own tracemalloc domain) and every Python object the manager allocates; the
caller's key objects exist before tracing starts and are not counted, the key
bytes the index copies into its table are. Events not yet taken by a router
are a bounded queue, not per resident block: counted apart, then drained.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from ..errors import TieredKVError
from ..manager import TierManager
from .rig import fresh_keys

KEY_BYTES = 32  # sha256 keys (keys.hash: sha256, the default)
FILL_BATCH = 4096


def bench_memory(blocks: int = 1_000_000, policy: str = "lru") -> dict:
    rng = np.random.default_rng(blocks)
    keys = fresh_keys(rng, blocks, KEY_BYTES)
    ids = np.arange(FILL_BATCH, dtype=np.int64)
    gc.collect()
    tracemalloc.start()
    try:
        base = _traced()
        manager = TierManager(blocks, None, KEY_BYTES, policy)
        for i in range(0, blocks, FILL_BATCH):
            batch = keys[i : i + FILL_BATCH]
            plan = manager.stores.prepare(batch, ids[: len(batch)])
            manager.stores.complete(plan, True)
        gc.collect()
        with_events = _traced()
        manager.take_events()  # a router would have taken them
        gc.collect()
        after = _traced()
    finally:
        tracemalloc.stop()
    cpu = manager.cpu
    if cpu.n_ready != blocks:
        raise TieredKVError(f"bench: the index holds {cpu.n_ready} of {blocks} blocks")
    arrays = cpu.nbytes() if callable(cpu.nbytes) else cpu.nbytes
    numpy_b, python_b = after[0] - base[0], after[1] - base[1]
    # Arrays the index reports but tracemalloc missed would still be memory: never count less than them.
    total = max(numpy_b, arrays) + python_b
    return {
        "resident_blocks": blocks, "policy": policy, "key_bytes": KEY_BYTES, "fill_batch": FILL_BATCH,
        "bytes_per_block": round(total / blocks, 1),
        "index_arrays_bytes_per_block": round(arrays / blocks, 1),
        "other_numpy_bytes_per_block": round(max(0, numpy_b - arrays) / blocks, 1),
        "python_objects_bytes_per_block": round(python_b / blocks, 2),
        "undrained_events_bytes_per_block": round((sum(with_events) - sum(after)) / blocks, 1),
    }  # fmt: skip


def _traced() -> tuple[int, int]:
    """(bytes in numpy's tracemalloc domain, bytes in every other domain) currently traced."""
    domain = np.lib.tracemalloc_domain
    numpy_b = other = 0
    for trace in tracemalloc.take_snapshot().traces:
        if trace.domain == domain:
            numpy_b += trace.size
        else:
            other += trace.size
    return numpy_b, other
