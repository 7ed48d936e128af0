"""The store side of the scheduler half: which blocks of each KV cache group a step's forward computed
are stored, under which tag, and the fences that keep a store from reading a block vLLM reused.

A full-attention group stores every prompt block once computed. A window or state group stores only
what a later hit at the prompt's last boundaries needs (groups.py), under a tag of its own: vLLM frees
those blocks while the request runs (``remove_skipped_blocks``, in the schedule that builds the next
step), so at the next step their stores are fenced (the workers wait for the sent ones before the
forward) and the unsent ones refused. A preempted request's stores of every group are fenced the same.
A request that finishes keeps its window stores fenced the same way: vLLM frees its out-of-window blocks
before it calls request_finished (``_connector_finished``), so holding its blocks does not cover them.
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ...cross_process import STORE
from ...scheduler.groups import FULL, Group, KVGroups
from ...scheduler.requests import Req, new_tag


@dataclass
class PlannedStore:
    tag: str
    keys: list[bytes]
    block_ids: list[int]
    prefix: list[bytes]  # the chain before keys[0] (a full group's continuation), else []
    first: int  # block index of keys[0]
    full: bool


class StoreBook:
    def __init__(self, groups: KVGroups, unit: int, counters: Counter[str]) -> None:
        self._groups = groups
        self._unit = unit  # tokens per hit unit (groups.py)
        self._counters = counters
        # Requests with window/state stores planned, fenced next step (also once finished and forgotten).
        self._windowed: dict[str, Req] = {}
        self._held: dict[str, list[concurrent.futures.Future]] = {}  # finished, blocks kept until stores resolve
        self._newly_held: list[str] = []

    def plan(self, req: Req, rid: str, done_tokens: int) -> list[PlannedStore]:
        """The stores of the blocks ``req``'s forward has computed up to ``done_tokens`` not yet planned."""
        out: list[PlannedStore] = []
        for p, g in enumerate(self._groups.groups):
            keys, ids = req.keys[p], req.block_ids[p]
            bs = g.tokens_per_block(self._unit)
            end = min(done_tokens, len(req.prompt), len(ids) * bs) // bs
            end = min(end, len(keys))
            start = req.next_store[p]
            if end <= start:
                continue
            req.next_store[p] = end
            if g.kind == FULL:
                idx, tag, prefix = list(range(start, end)), req.tag, keys[:start]
            else:  # only what a later hit at this prompt's last boundaries needs; never vLLM's null block 0
                idx = [i for i in self.window_blocks(g, len(req.prompt)) if start <= i < end and ids[i] > 0]
                if not idx:
                    continue
                if not req.window_tag:
                    req.window_tag = new_tag(rid)
                self._windowed[rid] = req
                tag, prefix = req.window_tag, []
            self._counters[f"stored_{g.kind}_blocks_planned"] += len(idx)
            out.append(PlannedStore(tag, [keys[i] for i in idx], [ids[i] for i in idx], prefix, idx[0],
                                    g.kind == FULL))  # fmt: skip
        return out

    def window_blocks(self, group: Group, prompt_len: int) -> list[int]:
        """A window/state group's blocks worth storing: what a hit at the prompt's last boundary needs,
        the same prompt again (one token short of it) or one that continues it (the whole prompt)."""
        again, longer = (prompt_len - 1) // self._unit, prompt_len // self._unit
        return sorted(set(group.needed(again, self._unit)) | set(group.needed(longer, self._unit)))

    def fence(self, proxy: Any, req: Req, rid: str) -> list[int]:
        """A preempted request's blocks are free now: no store of them may read them after this step's
        forward. Its unsent jobs (and any its pending stores submit later) fail at the proxy; the ids of
        its stores already sent are returned, for the workers to wait for before the forward."""
        sent: list[int] = []
        if req.pending_stores():
            for tag in filter(None, (req.tag, req.window_tag)):
                proxy.cancel_request(tag)
                sent += proxy.sent_jobs(tag, STORE)
        req.tag = new_tag(rid)  # a fresh tag: the fenced one refuses every later job
        req.window_tag = ""
        self._windowed.pop(rid, None)
        req.next_store = [0] * len(req.next_store)  # what the fenced stores did not land is stored again
        return sent

    def fence_windows(self, proxy: Any) -> list[int]:
        """The window/state stores planned last step, of running and finished requests alike: the sent
        ones' ids (to land before this step's forward reuses their blocks); the unsent ones are refused."""
        sent: list[int] = []
        for req in self._windowed.values():
            if not req.window_tag:
                continue
            proxy.cancel_request(req.window_tag)
            sent += proxy.sent_jobs(req.window_tag, STORE)
            req.window_tag = ""
        self._windowed.clear()
        self._counters["window_fenced_jobs"] += len(sent)
        return sent

    # -- finished requests whose blocks vLLM keeps for their stores (request_finished said True) ------
    def hold(self, rid: str, stores: list[concurrent.futures.Future]) -> bool:
        self._held[rid] = list(stores)
        self._newly_held.append(rid)
        return True

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def release_held(self, meta: Any) -> None:
        """Into this step's metadata: the requests newly held, and those whose stores all resolved."""
        for rid, futures in list(self._held.items()):
            if all(f.done() for f in futures):
                del self._held[rid]
                meta.stores_done.append(rid)
        meta.held, self._newly_held = self._newly_held, []
