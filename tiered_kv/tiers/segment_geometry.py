"""The shared CPU segment's geometry, pure: one module both halves of the split read it from.

File layout, rank-major::

    [header: one page of this system][rank 0 sub-slab][rank 1 sub-slab] ... [rank N-1 sub-slab]

Sub-slab r is ``uint8[num_slots, shard_bytes]``: slot s of rank r at ``rank_offset(r) + s * shard_bytes``.
Each starts on a page and is padded to whole pages, so a rank's sub-slab is one contiguous, page-aligned
buffer: the TP=1 copy path (one DMA per run of slots) serves every rank unchanged, and each rank page-locks
only its own sub-slab (cudaHostRegister works in whole pages: a sub-slab sharing a page with its
neighbour would fail with "already registered"). The header is one page of the *running* system (64 KiB
on some aarch64 kernels), for the same reason.

A whole block (what the scheduler's disk and remote tiers move) is the slot's ``world_size`` pieces in rank
order: records keep rank 0 .. N-1 byte order whatever the memory layout. The scheduler and every worker
compute ``SegmentInfo`` from their own numbers with ``segment_info_for``; whoever opens the segment second
checks the first one's (tiers/shared_cpu.py).
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

    @classmethod
    def for_engine(cls, directory: str, engine_id: str, *, world_size: int, shard_bytes: int,
                   num_slots: int, page: int = PAGE) -> SegmentInfo:  # fmt: skip
        for what, value in (("world_size", world_size), ("shard_bytes", shard_bytes), ("num_slots", num_slots),
                            ("page", page)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"shared CPU tier: {what} must be an int >= 1, got {value!r}")
        if page & (page - 1):
            raise ConfigError(f"shared CPU tier: page must be a power of two, got {page}")
        return cls(os.path.join(directory, segment_name(engine_id)), world_size, shard_bytes, num_slots, page)

    @property
    def row_bytes(self) -> int:
        """A whole block: every rank's shard of one slot."""
        return self.world_size * self.shard_bytes

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

    def rank_offset(self, rank: int) -> int:
        """Where rank ``rank``'s sub-slab starts in the file (a multiple of the page)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is outside the segment's TP group of world_size {self.world_size}")
        return self.header_bytes + rank * self.rank_stride

    @property
    def file_bytes(self) -> int:
        return self.header_bytes + self.world_size * self.rank_stride


def segment_name(name: str) -> str:
    """The file name of an engine instance's segment (characters a file name should not hold replaced)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"the shared CPU tier needs a non-empty engine instance name, got {name!r}")
    return PREFIX + re.sub(r"[^A-Za-z0-9._-]", "_", name)[:200] + SUFFIX


def group_layout(shard_layout: KVLayout, world_size: int) -> KVLayout:
    """The TP group's layout: ``shard_layout``'s storages repeated for ranks 0 .. world_size - 1.

    Its block is the disk and remote record: rank 0's regions, then rank 1's, and so on.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world_size must be an int >= 1, got {world_size!r}")
    return KVLayout.from_specs(shard_layout.storages * world_size, shard_layout.num_blocks,
                               tensors=shard_layout.tensors * world_size,
                               block_tokens=shard_layout.block_tokens)  # fmt: skip


def group_shard_id(world_size: int) -> str:
    """The key and disk namespace's shard name for a whole TP group of ``world_size`` ranks."""
    return f"tp-group-of{world_size}"


def segment_info_for(config: Config | str | dict | None, shard_layout: KVLayout, *, world_size: int,
                     engine_id: str, page: int = PAGE) -> SegmentInfo:  # fmt: skip
    """The segment an engine's scheduler and every rank open: each side computes it from its own
    numbers (a worker from its bound tensors), so whoever opens second checks the first one's."""
    cfg = load_config(config)
    rows = cpu_rows(cfg, group_layout(shard_layout, world_size))  # exactly the scheduler cache's slab rows
    return SegmentInfo.for_engine(cfg.tiers.cpu.shared_path, engine_id, world_size=world_size,
                                  shard_bytes=shard_layout.bytes_per_block, num_slots=rows, page=page)  # fmt: skip


def rank_regions(region_block_bytes: Sequence[int], info: SegmentInfo) -> list[tuple[int, int, int]]:
    """The group layout's regions as ``(rank, offset in that rank's shard, width)``.

    The group layout is one rank's regions repeated in rank order, so the regions tile each shard exactly;
    a region that would straddle two ranks' shards is a LayoutError naming the numbers.
    """
    if sum(region_block_bytes) != info.row_bytes:
        raise LayoutError(f"the layout gives {sum(region_block_bytes)} bytes per block but the segment's blocks "
                          f"are {info.world_size} x {info.shard_bytes} = {info.row_bytes} bytes")  # fmt: skip
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
