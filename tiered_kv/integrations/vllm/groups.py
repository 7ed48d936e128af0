"""vLLM's KV cache groups as tiered_kv sees them: what each group stores, what a hit needs from it.

With vLLM's hybrid allocator on, a model's layers fall into KV cache groups, each with its own block
table over one shared pool of block ids (a block id is owned by one group at a time, and every group's
block is a page of the same size, so one CPU slot fits a block of any group; see block_bytes.py). tiered_kv
keys a block per (block, group) and, per group kind, keeps what a later hit at a block boundary
``B`` (tokens ``[0, B * block_size)`` computed) needs:

- ``full``: every block before ``B`` (full attention, MLA): the prefix;
- ``sliding``: only the blocks holding the last window before ``B`` (vLLM frees the rest), from the
  block of token ``B * block_size - window + 1`` on;
- ``mamba`` (``mamba_cache_mode="align"``): the state block ending at ``B`` alone.

A hit is the longest boundary at which every group has what it needs. Duck-typed over vLLM's
``KVCacheConfig``: only attribute and class names are read, so this module imports without vLLM.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError

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

    def needed(self, boundary: int, block_size: int) -> range:
        """The block indices a hit ending at block ``boundary`` needs from this group."""
        if boundary <= 0:
            return range(0)
        if self.kind == FULL:
            return range(0, boundary)
        if self.kind == SLIDING:
            skipped = max(0, boundary * block_size - self.window + 1)
            return range(skipped // block_size, boundary)
        return range(boundary - 1, boundary)  # MAMBA: the state after the boundary's last token


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
            if kind == SLIDING:
                window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            layers = tuple(g.layer_names)
            # One group keeps the plain keys (a one-group model's records stay readable across versions).
            salt = () if len(specs) == 1 else _group_salt(kind, layers)
            out.append(Group(i, kind, layers, window, salt))
        if not out:
            raise ConfigError("tiered_kv: no KV cache group of this model is prefix-cacheable: nothing to store")
        if any(g.kind == MAMBA for g in out) and not any(g.kind == FULL for g in out):
            raise ConfigError("tiered_kv: a model whose only cacheable groups are Mamba state has no prefix to key")
        return cls(tuple(out), len(specs))

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.groups)

    def describe(self) -> str:
        return ", ".join(f"{g.index}:{g.kind}" + (f"(window {g.window})" if g.window else "") for g in self.groups)
