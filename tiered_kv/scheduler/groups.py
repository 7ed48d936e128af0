"""vLLM's KV cache groups as tiered_kv sees them: what each group stores, what a hit needs from it.

With vLLM's hybrid allocator on, a model's layers fall into KV cache groups, each with its own block
table over one shared pool of block ids (a block id is owned by one group at a time, and one CPU slot
holds everything a block id owns, whichever group holds it; see placements.py). tiered_kv keys a block
per (block, group) and, per group kind, keeps what a later hit at a boundary ``B`` (tokens ``[0, B *
unit)`` computed) needs:

- ``full``: every block before ``B`` (full attention, MLA): the prefix;
- ``sliding``: only the blocks holding the last window before ``B`` (vLLM frees the rest), from the
  block of token ``B * unit - window + 1`` on;
- ``mamba`` (``mamba_cache_mode="align"``): the state block ending at ``B`` alone.

The ``unit`` is the engine's block when every group has the same block size; groups of several sizes
(DeepSeek-V4: 256-token compressed caches, 64-token windows, 4- and 8-token compressor states) have their
own keys at their own block size, and a hit ends on a multiple of every size (their lcm, and vLLM's
``cache_hit_alignment_tokens``), as vLLM's own prefix cache aligns it.

A hit is the longest boundary at which every group has what it needs. Duck-typed over vLLM's
``KVCacheConfig``: only attribute and class names are read, so this module imports without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

FULL, SLIDING, MAMBA = "full", "sliding", "mamba"

_FULL_SPECS = {"FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec"}
_SLIDING_SPECS = {"SlidingWindowSpec", "SlidingWindowMLASpec"}
_SKIPPED_SPECS = {"EncoderOnlyAttentionSpec", "CrossAttentionSpec"}  # no prefix to cache across requests


@dataclass(frozen=True)
class Group:
    index: int  # vLLM's kv cache group id (its position in kv_cache_groups and in block_ids tuples)
    kind: str  # FULL, SLIDING or MAMBA
    layers: tuple[str, ...]
    window: int = 0  # SLIDING: tokens attended (vLLM's sliding_window), plus its extra retained tokens
    salt: tuple[int, ...] = ()  # chained onto each block's key so every group has keys of its own
    block_size: int = 0  # tokens per block of this group; 0: the unit's (every group's blocks alike)

    def tokens_per_block(self, unit: int) -> int:
        return self.block_size or unit

    def blocks(self, units: int, unit: int) -> int:
        """This group's blocks in ``units`` hit units of ``unit`` tokens (a unit is whole blocks of every group)."""
        return units * unit // self.tokens_per_block(unit)

    def needed(self, boundary: int, unit: int) -> range:
        """This group's block indices a hit ending at unit ``boundary`` (token ``boundary * unit``) needs."""
        if boundary <= 0:
            return range(0)
        bs = self.tokens_per_block(unit)
        end = boundary * unit // bs
        if self.kind == FULL:
            return range(0, end)
        if self.kind == SLIDING:
            skipped = max(0, boundary * unit - self.window + 1)
            return range(skipped // bs, end)
        return range(end - 1, end)  # MAMBA: the state after the boundary's last token


def _spec_kind(spec: Any, cache_mode: str) -> str | None:
    """The group kind of one layer spec; None for a group no prefix hit involves; ConfigError if unsupported."""
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":  # one type, several shapes: its members decide
        kinds = {_spec_kind(s, cache_mode) for s in spec.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise ConfigError(f"tiered_kv: a uniform-type KV cache group mixes kinds {sorted(map(str, kinds))}")
        return kinds.pop()
    if name in _FULL_SPECS:
        return FULL
    if name in _SLIDING_SPECS:
        return SLIDING
    if name == "MambaSpec":
        mode = getattr(spec, "mamba_cache_mode", cache_mode) or cache_mode
        if mode != "align":
            raise ConfigError(
                f"tiered_kv: a Mamba/linear-attention KV cache group needs mamba_cache_mode='align' (it is "
                f"{mode!r}): only then does vLLM keep the state at each block boundary, which a hit restores; "
                "set cache_config.mamba_cache_mode='align' (vllm serve --mamba-cache-mode align)"
            )
        return MAMBA
    if name in _SKIPPED_SPECS:
        return None
    raise ConfigError(
        f"tiered_kv: KV cache spec {name} is not supported (full attention, MLA, sliding window and Mamba in "
        "'align' mode are): refusing to start rather than serve KV it cannot restore"
    )


def _group_salt(kind: str, layers: tuple[str, ...]) -> tuple[int, ...]:
    digest = hashlib.sha256(json.dumps(["tiered-kv-group-v1", kind, list(layers)]).encode()).digest()
    return tuple(int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8))


@dataclass(frozen=True)
class KVGroups:
    """Every KV cache group that tiered_kv stores and restores, in vLLM's group order."""

    groups: tuple[Group, ...]
    num_groups: int  # all of vLLM's groups, the ones tiered_kv leaves alone included
    # Groups with blocks of several token sizes (DeepSeek-V4: 256, 64, 8 and 4): a hit ends on a multiple
    # of every one (and of vLLM's cache_hit_alignment_tokens), ``unit`` tokens; 0: one block size, the
    # engine's block is the unit.
    unit: int = 0

    @classmethod
    def from_config(cls, kv_cache_config: Any, cache_mode: str = "none") -> KVGroups:
        specs = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not specs:  # a config without groups (a hand-built one): its one group is the prefix
            return cls((Group(0, FULL, ()),), 1)
        cacheable = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
        cacheable = set(range(len(specs))) if cacheable is None else set(cacheable)
        out: list[Group] = []
        for i, g in enumerate(specs):
            kind = _spec_kind(g.kv_cache_spec, cache_mode)
            if kind is None or i not in cacheable:
                continue
            spec = g.kv_cache_spec
            window = 0
            if kind == SLIDING:  # a uniform-type wrapper (a worker's config) holds one spec per layer
                member = next(iter(spec.kv_cache_specs.values())) if hasattr(spec, "kv_cache_specs") else spec
                window = int(member.sliding_window) + int(getattr(member, "extra_retained_tokens", 0) or 0)
            layers = tuple(g.layer_names)
            # One group keeps the plain keys (a one-group model's records stay readable across versions).
            salt = () if len(specs) == 1 else _group_salt(kind, layers)
            out.append(Group(i, kind, layers, window, salt, int(getattr(spec, "block_size", 0) or 0)))
        if not out:
            raise ConfigError("tiered_kv: no KV cache group of this model is prefix-cacheable: nothing to store")
        if any(g.kind == MAMBA for g in out) and not any(g.kind == FULL for g in out):
            raise ConfigError("tiered_kv: a model whose only cacheable groups are Mamba state has no prefix to key")
        sizes = {g.block_size for g in out}
        if len(sizes) == 1 or 0 in sizes:  # one block size (or a hand-built config): the engine's block is the unit
            return cls(tuple(Group(g.index, g.kind, g.layers, g.window, g.salt) for g in out), len(specs))
        unit = math.lcm(*sizes, int(getattr(kv_cache_config, "cache_hit_alignment_tokens", 0) or 1))
        return cls(tuple(out), len(specs), unit)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.groups)

    def unit_tokens(self, block_size: int) -> int:
        """Tokens per hit unit: ``unit``, or the engine's ``block_size`` when every group has its blocks."""
        return self.unit or block_size

    def describe(self) -> str:
        return ", ".join(f"{g.index}:{g.kind}" + (f"(window {g.window})" if g.window else "")
                         + (f"[{g.block_size} tokens]" if g.block_size else "") for g in self.groups)  # fmt: skip
