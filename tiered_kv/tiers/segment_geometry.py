"""The shared CPU segment's geometry, pure: one module both halves of the split read it from.

File layout, rank-major::

    [header: one page of this system][rank 0 sub-slab][rank 1 sub-slab] ... [rank N-1 sub-slab]

Sub-slab r is ``uint8[num_slots, shard_bytes]``: slot s of rank r at ``rank_offset(r) + s * shard_bytes``.
Each starts on a page and is padded to whole pages, so a rank's sub-slab is one contiguous, page-aligned
buffer: the TP=1 copy path (one DMA per run of slots) serves every rank unchanged, and each rank page-locks
only its own sub-slab (cudaHostRegister works in whole pages: a sub-slab sharing a page with its
neighbour would fail with "already registered"). The header is one page of the *running* system (64 KiB
on some aarch64 kernels), for the same reason.

A whole block (what the scheduler's disk and remote tiers move) is the slot's ``storage_ranks`` pieces in
rank order: records keep rank 0 .. N-1 byte order whatever the memory layout. The scheduler and every worker
compute ``SegmentInfo`` from their own numbers with ``segment_info_for``; whoever opens the segment second
checks the first one's (tiers/shared_cpu.py).

**KV replicated across TP ranks** (MLA: DeepSeek V2/V3's latent KV is the same on every rank). ``kv_replicas``
consecutive TP ranks hold identical KV (vLLM's ``kv_cache_config.kv_tp_replicas``; 1: none), so the segment
stores ``storage_ranks = world_size // kv_replicas`` sub-slabs, not ``world_size``: TP rank r reads and writes
sub-slab ``r // kv_replicas`` (``storage_rank_of``), and only the first rank of each replica set copies a
store into it (``stores``); the others acknowledge the job without copying. A block, a disk record and a
remote value then hold ``storage_ranks`` shards: at TP=2 with MLA, one rank's, half of what a copy per rank
takes. With ``kv_replicas == 1`` every number here is what it was before replication existed.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..capacity import cpu_rows
from ..config import Config, load_config, read_config_data, validate_config
from ..errors import ConfigError, LayoutError
from ..layout import KVLayout

PAGE = max(4096, mmap.PAGESIZE)
PREFIX, SUFFIX = "tkv-", ".kv"


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class SegmentInfo:
    """A segment's path and geometry (see the module docstring). ``page``: the running system's page."""

    path: str
    world_size: int
    shard_bytes: int
    num_slots: int
    page: int = PAGE
    kv_replicas: int = 1  # consecutive TP ranks holding identical KV, stored once (module docstring)

    @classmethod
    def for_engine(cls, directory: str, engine_id: str, *, world_size: int, shard_bytes: int,
                   num_slots: int, page: int = PAGE, kv_replicas: int = 1) -> SegmentInfo:  # fmt: skip
        for what, value in (("world_size", world_size), ("shard_bytes", shard_bytes), ("num_slots", num_slots),
                            ("page", page)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"shared CPU tier: {what} must be an int >= 1, got {value!r}")
        if page & (page - 1):
            raise ConfigError(f"shared CPU tier: page must be a power of two, got {page}")
        storage_ranks(world_size, kv_replicas)  # ConfigError unless kv_replicas divides world_size
        return cls(os.path.join(directory, segment_name(engine_id)), world_size, shard_bytes, num_slots, page,
                   kv_replicas)  # fmt: skip

    @property
    def storage_ranks(self) -> int:
        """Sub-slabs in the segment (and shards in a block): ``world_size // kv_replicas``."""
        return self.world_size // self.kv_replicas

    def storage_rank_of(self, rank: int) -> int:
        """The sub-slab TP rank ``rank`` reads and writes (LayoutError for a rank outside the group)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is outside the segment's TP group of world_size {self.world_size}")
        return rank // self.kv_replicas

    def stores(self, rank: int) -> bool:
        """Whether TP rank ``rank`` copies stores into its sub-slab: the first rank of its replica set only."""
        return self.storage_rank_of(rank) * self.kv_replicas == rank

    @property
    def row_bytes(self) -> int:
        """A whole block: every stored shard of one slot (``storage_ranks`` x ``shard_bytes``)."""
        return self.storage_ranks * self.shard_bytes

    @property
    def header_bytes(self) -> int:
        return self.page

    @property
    def sub_slab_bytes(self) -> int:
        """The bytes of one rank's slots (its sub-slab without the padding to the next page)."""
        return self.num_slots * self.shard_bytes

    @property
    def rank_stride(self) -> int:
        """From one rank's sub-slab to the next: its bytes rounded up to whole pages."""
        return round_up(self.sub_slab_bytes, self.page)

    def sub_slab_offset(self, storage_rank: int) -> int:
        """Where sub-slab ``storage_rank`` (0 .. storage_ranks - 1) starts in the file (a multiple of the page)."""
        if isinstance(storage_rank, bool) or not isinstance(storage_rank, int) \
                or not 0 <= storage_rank < self.storage_ranks:  # fmt: skip
            raise LayoutError(f"sub-slab {storage_rank!r} is outside the segment's {self.storage_ranks} stored ranks "
                              f"(world_size {self.world_size}, kv_replicas {self.kv_replicas})")  # fmt: skip
        return self.header_bytes + storage_rank * self.rank_stride

    def rank_offset(self, rank: int) -> int:
        """Where TP rank ``rank``'s sub-slab starts in the file (ranks of one replica set share one)."""
        return self.sub_slab_offset(self.storage_rank_of(rank))

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.storage_ranks * self.rank_stride


def segment_name(name: str) -> str:
    """The file name of an engine instance's segment (characters a file name should not hold replaced)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"the shared CPU tier needs a non-empty engine instance name, got {name!r}")
    return PREFIX + re.sub(r"[^A-Za-z0-9._-]", "_", name)[:200] + SUFFIX


def storage_ranks(world_size: int, kv_replicas: int = 1) -> int:
    """How many TP ranks' shards a block stores: ``world_size // kv_replicas`` (1 when every rank's KV is
    the same, e.g. MLA). ConfigError unless both are ints >= 1 and ``kv_replicas`` divides ``world_size``."""
    for what, value in (("world_size", world_size), ("kv_replicas", kv_replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{what} must be an int >= 1, got {value!r}")
    if world_size % kv_replicas:
        raise ConfigError(f"kv_replicas (TP ranks holding identical KV, vLLM's kv_cache_config.kv_tp_replicas) is "
                          f"{kv_replicas}, which does not divide the TP size {world_size}")  # fmt: skip
    return world_size // kv_replicas


def group_layout(shard_layout: KVLayout, world_size: int, kv_replicas: int = 1) -> KVLayout:
    """The TP group's stored layout: ``shard_layout``'s storages repeated for each stored rank
    (``storage_ranks(world_size, kv_replicas)`` of them: every rank, or one when the KV is replicated).

    Its block is the disk and remote record: stored rank 0's regions, then stored rank 1's, and so on.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world_size must be an int >= 1, got {world_size!r}")
    stored = storage_ranks(world_size, kv_replicas)
    return KVLayout.from_specs(shard_layout.storages * stored, shard_layout.num_blocks,
                               tensors=shard_layout.tensors * stored,
                               block_tokens=shard_layout.block_tokens)  # fmt: skip


def group_shard_id(world_size: int, kv_replicas: int = 1) -> str:
    """The key and disk namespace's shard name for a whole TP group of ``world_size`` ranks.

    Replicated KV gets a name of its own: its records hold ``world_size // kv_replicas`` shards, not
    ``world_size`` (the layout digest differs too; the name says so where a person reads it). KV that is
    the same on every rank is ``-replicated``, the name the first version of this gave it (its disk tiers
    read back); consecutive pairs (or more) of ranks sharing it, ``-stored<n>``.
    """
    stored = storage_ranks(world_size, kv_replicas)
    if kv_replicas == 1:
        return f"tp-group-of{world_size}"
    return f"tp-group-of{world_size}-" + ("replicated" if stored == 1 else f"stored{stored}")


def segment_info_for(config: Config | str | dict | None, shard_layout: KVLayout, *, world_size: int,
                     engine_id: str, page: int = PAGE, kv_replicas: int = 1) -> SegmentInfo:  # fmt: skip
    """The segment an engine's scheduler and every rank open: each side computes it from its own
    numbers (a worker from its bound tensors), so whoever opens second checks the first one's.
    ``kv_replicas``: TP ranks holding identical KV (module docstring), stored once."""
    cfg = load_config(config)
    rows = cpu_rows(cfg, group_layout(shard_layout, world_size, kv_replicas))  # exactly the scheduler cache's rows
    return SegmentInfo.for_engine(cfg.tiers.cpu.shared_path, engine_id, world_size=world_size,
                                  shard_bytes=shard_layout.bytes_per_block, num_slots=rows, page=page,
                                  kv_replicas=kv_replicas)  # fmt: skip


def rank_regions(region_block_bytes: Sequence[int], info: SegmentInfo) -> list[tuple[int, int, int]]:
    """The group layout's regions as ``(stored rank, offset in that rank's shard, width)``.

    The group layout is one rank's regions repeated for each stored rank, so the regions tile each shard
    exactly; a region that would straddle two ranks' shards is a LayoutError naming the numbers.
    """
    if sum(region_block_bytes) != info.row_bytes:
        raise LayoutError(f"the layout gives {sum(region_block_bytes)} bytes per block but the segment's blocks "
                          f"are {info.storage_ranks} x {info.shard_bytes} = {info.row_bytes} bytes ({info.storage_ranks} stored "
                          f"ranks: world_size {info.world_size}, kv_replicas {info.kv_replicas})")  # fmt: skip
    out, at = [], 0
    for width in region_block_bytes:
        rank, offset = divmod(at, info.shard_bytes)
        if offset + width > info.shard_bytes:
            raise LayoutError(f"a {width}-byte region at byte {at} of the block straddles TP ranks {rank} and "
                              f"{rank + 1} (shards of {info.shard_bytes} bytes)")  # fmt: skip
        out.append((rank, offset, width))
        at += width
    return out


def segment_config(raw: str | os.PathLike[str] | Mapping[str, Any] | Config, *, group_bytes_per_block: int) -> Config:
    """The settings a worker sizes the segment with: the config's ``tiers.cpu`` and ``transfer`` sections.

    A worker needs nothing else (no keys, no disk, no remote), so those alone are validated, with the TP
    group's bytes per block as the model's: the capacity checks then see the block the scheduler sees.
    """
    if isinstance(raw, Config):
        return raw
    data = read_config_data(raw) if isinstance(raw, (str, os.PathLike)) else raw
    if not isinstance(data, Mapping):
        raise ConfigError(f"the tiered_kv config must be a mapping of sections, got {type(data).__name__}")
    tiers = data.get("tiers") or {}
    if not isinstance(tiers, Mapping):
        raise ConfigError(f"tiers: must be a mapping, got {tiers!r}")
    doc: dict[str, Any] = {"model": {"bytes_per_block": group_bytes_per_block},
                           "tiers": {"cpu": tiers.get("cpu") or {}, "disk": {"enabled": False}}}  # fmt: skip
    if data.get("transfer") is not None:
        doc["transfer"] = data["transfer"]
    return validate_config(doc, "config (its tiers.cpu and transfer sections)")
