"""What the scheduler half remembers per vLLM request, keyed so that a request id can come back.

A request id is not one lifetime: a streaming-input session arrives chunk by chunk under one id (each
chunk scheduled as a new request, its prompt grown), vLLM's V2 model runner resumes a preempted request
as a new one, and a client may reuse an id after the first finished. So:

- the per-id state (``Req``) outlives a re-scheduling: its prompt, keys and block ids are updated in
  place and the stores it has in flight stay counted until ``request_finished``;
- every job tag is ``<id>#<n>`` with ``n`` from one counter for the whole scheduler, never reset, so a
  tag fenced at a preemption (its later jobs refused) is never handed to a later incarnation;
- keys are recomputed when the prompt changed (a streaming chunk appends to it).
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
    keys: list[bytes]  # of every full prompt block
    block_ids: list[int]
    tag: str
    next_store: int = 0  # first block not yet queued for a store (or known resident)
    stores: list[concurrent.futures.Future] = field(default_factory=list)  # in flight, over every incarnation

    def pending_stores(self) -> list[concurrent.futures.Future]:
        self.stores = [f for f in self.stores if not f.done()]
        return self.stores


class KeyCache:
    """Keys of a request's full prompt blocks, computed once per prompt (recomputed when it grows)."""

    def __init__(self, compute: Callable[[str, list[int]], list[bytes]]) -> None:
        self._compute = compute
        self._keys: dict[str, tuple[int, list[bytes]]] = {}

    def get(self, rid: str, prompt: list[int]) -> list[bytes]:
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
