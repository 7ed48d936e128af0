"""A TieredKVCache's loads and stores planned in the caller's own thread (no await, no loop hop).

For a caller that holds the cache's state lock (``state_lock.StateLock``: the loop that runs the cache is
parked between callbacks, and is that thread's running loop meanwhile) and whose copy engine queues jobs
without a loop (``copy_now``: the cross-process proxy engine). Each call plans with the manager at once;
what must wait for I/O (a promotion, a spill, room, the byte budget) comes back as a coroutine for the
loop. Outcomes come back on ``concurrent.futures.Future``s, resolved when the copy's engine reports it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine, Sequence
from typing import Any

from .cache import TieredKVCache
from .cache_args import call_blocks, store_chain

Outcome = tuple[concurrent.futures.Future | None, Coroutine[Any, Any, Any] | None]


def load_sync(cache: TieredKVCache, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> tuple[Any, Any, int]:
    """Load the leading CPU-resident keys into the GPU blocks (transfer.runners.load.LoadRunner.load_sync):
    (outcome: blocks landed, None, planned), (None, None, 0) when nothing could start, or (None, rest, 0)
    when the plan must wait for I/O (``rest`` runs it on the loop, copying nothing into the GPU blocks)."""
    ids = call_blocks(cache, keys, gpu_block_ids)
    return cache.runners.loads.load_sync(list(keys), ids)


def store_sync(cache: TieredKVCache, keys: Sequence[bytes], gpu_block_ids: Sequence[int], *,
               prefix: Sequence[bytes] = (), session: str | int | None = None,
               expect_followup: bool = False) -> Outcome:  # fmt: skip
    """TieredKVCache.store planned now (StoreRunner.store_sync): (outcome: StoreResult, None), or (None,
    rest) when it must wait (``rest`` runs it on the loop)."""
    ids = call_blocks(cache, keys, gpu_block_ids)
    keys, prefix = store_chain(cache, keys, prefix, session, expect_followup)
    return cache.runners.stores.store_sync(keys, ids, prefix)
