"""What the scheduler half remembers per vLLM request, keyed so that a request id can come back.

A request id is not one lifetime: a streaming-input session arrives chunk by chunk under one id (each
chunk scheduled as a new request, its prompt grown), vLLM's V2 model runner resumes a preempted request
as a new one, and a client may reuse an id after the first finished. So:

- the per-id state (``Req``) outlives a re-scheduling: its prompt, keys and block ids are updated in
  place and the stores it has in flight stay counted until ``request_finished``;
- every job tag is ``<id>#<n>`` with ``n`` from one counter for the whole scheduler, never reset, so a
  tag fenced at a preemption (its later jobs refused) is never handed to a later incarnation;
- keys are recomputed when the prompt changed (a streaming chunk appends to it).

Keys, block ids and the store cursor are kept per KV cache group tiered_kv stores (groups.py), in the
order of ``KVGroups.groups``. Stores of groups that keep only a window or a state (not the prefix) carry
a tag of their own: vLLM frees those blocks while the request runs, so the scheduler fences them at the
next step and refuses any that did not start (stores.StoreBook.fence_windows).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

_TAGS = itertools.count(1)


def new_tag(rid: str) -> str:
    return f"{rid}#{next(_TAGS)}"


@dataclass
class Req:
    """One request id's state in the scheduler half."""

    prompt: list[int]
    keys: list[list[bytes]]  # per group: the key of every full prompt block
    block_ids: list[list[int]]  # per group: vLLM's block ids, by block index
    tag: str
    window_tag: str = ""  # the stores of window/state groups (empty: none planned since the last fence)
    next_store: list[int] = field(default_factory=list)  # per group: first block not yet queued for a store
    stores: list[concurrent.futures.Future] = field(default_factory=list)  # in flight, over every incarnation
    tail_done: tuple[str, int] = ("", 0)  # (tag, prompt length) whose partial tail store is planned (tails.py)

    def store_from(self, upto: list[int]) -> None:
        """Nothing before block ``upto[p]`` of group ``p`` needs storing (it was loaded, or is resident)."""
        self.next_store = [max(n, u) for n, u in zip(self.next_store, upto, strict=True)]

    def pending_stores(self) -> list[concurrent.futures.Future]:
        self.stores = [f for f in self.stores if not f.done()]
        return self.stores


class KeyCache:
    """Keys of a request's full prompt blocks per group, computed once per prompt (again when it grows)."""

    def __init__(self, compute: Callable[[str, list[int]], list[list[bytes]]]) -> None:
        self._compute = compute
        self._keys: dict[str, tuple[int, list[list[bytes]]]] = {}

    def get(self, rid: str, prompt: list[int]) -> list[list[bytes]]:
        cached = self._keys.get(rid)
        if cached is not None and cached[0] == len(prompt):
            return cached[1]
        keys = self._compute(rid, prompt)
        self._keys[rid] = (len(prompt), keys)
        return keys

    def pop(self, rid: str) -> None:
        self._keys.pop(rid, None)

    def clear(self) -> None:
        self._keys.clear()


def vllm_cache_is_empty(kv_cache_manager: object) -> bool:
    """vLLM's reset_prefix_cache succeeded just before it resets the connector iff no block but the
    null one is in use (BlockPool.reset_prefix_cache's own test)."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    if pool is None:
        return True
    return pool.num_gpu_blocks - pool.get_num_free_blocks() == 1
