"""What a cache's blocks mean: geometry checked against the config, the key namespace, the disk namespace.

Both the worker (``TieredKVCache``) and a scheduler process that holds no
tensors build keys through ``make_keyer(config, layout, shard=...)``. The
scheduler gets the layout from the worker's ``layout.spec()`` (JSON) via
``KVLayout.from_spec``; equal inputs give equal keys, and any difference in
model, revision, dtype, layout, block size, shard or tenant gives other keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config
from .errors import ConfigError
from .formats import DiskNamespace
from .formats import remote_namespace as hashed_namespace
from .keys import BlockKeyer, KeyNamespace
from .layout import KVLayout


@dataclass(frozen=True)
class Geometry:
    """The geometry a cache runs with: stated by the config or, where it is silent, taken from the layout."""

    dtype: str
    block_tokens: int
    bytes_per_block: int
    num_blocks: int


def _stated(section: object, name: str) -> bool:
    return name in getattr(section, "model_fields_set", ())


def resolve_geometry(cfg: Config, layout: KVLayout) -> Geometry:
    """Every geometry fact the config states must equal the layout's; ConfigError names both values."""
    m = cfg.model
    model_stated = _stated(cfg, "model")  # a config with no model section states nothing about it
    problems: list[str] = []
    if model_stated and _stated(m, "dtype") and layout.dtype is not None and layout.dtype != m.dtype:
        problems.append(f"model.dtype: the config says {m.dtype} but the KV tensors are {layout.dtype}")
    if (model_stated and _stated(m, "block_tokens") and layout.block_tokens is not None
            and layout.block_tokens != m.block_tokens):  # fmt: skip
        problems.append(
            f"model.block_tokens: the config says {m.block_tokens} but the layout has {layout.block_tokens}"
        )
    if model_stated and cfg.bytes_per_block != layout.bytes_per_block:
        how = "model.bytes_per_block" if m.bytes_per_block is not None else (
            "model geometry (block_tokens * num_kv_heads * head_dim * dtype size * num_layers * kv_tensors_per_layer)"
        )  # fmt: skip
        problems.append(
            f"{how}: the config gives bytes_per_block = {cfg.bytes_per_block} but the KV tensors give "
            f"{layout.bytes_per_block} ({layout.num_regions} regions of {sorted(set(layout.region_block_bytes))} bytes)"
        )
    if _stated(cfg, "gpu") and _stated(cfg.gpu, "num_blocks") and cfg.gpu.num_blocks != layout.num_blocks:
        problems.append(f"gpu.num_blocks: the config says {cfg.gpu.num_blocks} but the KV tensors hold "
                        f"{layout.num_blocks} blocks")  # fmt: skip
    if problems:
        raise ConfigError("config and KV layout disagree: " + "; ".join(problems))
    dtype = m.dtype if (model_stated and _stated(m, "dtype")) or layout.dtype is None else layout.dtype
    block_tokens = layout.block_tokens if layout.block_tokens is not None else m.block_tokens
    return Geometry(dtype, block_tokens, layout.bytes_per_block, layout.num_blocks)


def shard_name(rank: int = 0, world_size: int = 1, shard_id: str | None = None) -> str:
    """``tp<rank>of<world_size>``, or the engine's own shard id (e.g. ``tp1-pp0``)."""
    if shard_id is not None:
        if not isinstance(shard_id, str) or not shard_id or any(c in shard_id for c in "/\\\x00"):
            raise ConfigError(f"shard_id must be a non-empty string without '/' or NUL, got {shard_id!r}")
        return shard_id
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size): rank={rank}, world_size={world_size}")
    return f"tp{rank}of{world_size}"


def make_keyer(
    cfg: Config, layout: KVLayout, *, rank: int = 0, world_size: int = 1, shard_id: str | None = None
) -> BlockKeyer:
    """The keyer of a cache with this config, layout and shard; needs no tensors and no live cache."""
    geo = resolve_geometry(cfg, layout)
    m = cfg.model
    ns = KeyNamespace(
        m.model_id, geo.dtype, layout.digest, geo.block_tokens, cfg.keys.tenant_salt, m.revision,
        shard_name(rank, world_size, shard_id),
    )  # fmt: skip
    return BlockKeyer(ns, cfg.keys.hash)


def disk_namespace(keyer: BlockKeyer, layout: KVLayout) -> DiskNamespace:
    """The disk directory's identity: another model, revision, layout or shard never reads these blocks."""
    ns = keyer.namespace
    return DiskNamespace(ns.model_id, ns.dtype, ns.layout_digest, layout.bytes_per_block, keyer.key_bytes,
                         revision=ns.revision, shard=ns.shard)  # fmt: skip


def remote_namespace(keyer: BlockKeyer, layout: KVLayout) -> str:
    """The remote tier's namespace: the same facts as the disk's, plus the tenant, hashed."""
    ns = keyer.namespace
    return hashed_namespace(ns.model_id, ns.revision, ns.dtype, ns.layout_digest, layout.bytes_per_block,
                  keyer.key_bytes, ns.shard, ns.tenant_salt)  # fmt: skip
