"""Capacity planning: bytes per block, slots and tokens per tier, from a config alone."""

from __future__ import annotations

from typing import Any

from .config import Config
from .formats import REMOTE_HEADER_SIZE
from .layout import KVLayout
from .sizes import format_size


def tier_slots(cfg: Config, layout: KVLayout) -> dict[str, int]:
    """Slots of every enabled offload tier: the one code path ``plan`` and ``TieredKVCache`` share."""
    slots = {"cpu": layout.slots_for(cfg.tiers.cpu.capacity)}
    if cfg.tiers.disk.enabled:
        slots["disk"] = layout.slots_for(cfg.tiers.disk.capacity)
    return slots


STAGING_BYTES = 64 << 20  # at most this much slab beside the CPU tier for exclusive loads' disk/remote hits


def promote_chunk(cfg: Config, layout: KVLayout) -> int:
    """Blocks promoted per chunk: a prefix longer than the CPU tier loads through it in chunks."""
    budget_blocks = max(1, cfg.transfer.max_inflight_bytes // layout.bytes_per_block)
    return max(1, min(layout.slots_for(cfg.tiers.cpu.capacity) // 2, budget_blocks))


def staging_rows(cfg: Config, layout: KVLayout) -> int:
    """Rows beside the CPU tier's slots (not part of its capacity) that exclusive loads stage through."""
    return min(promote_chunk(cfg, layout), max(1, STAGING_BYTES // layout.bytes_per_block))


def cpu_rows(cfg: Config, layout: KVLayout) -> int:
    """Rows of the CPU slab a cache allocates: its slots plus its staging rows (a shared segment's size)."""
    return tier_slots(cfg, layout)["cpu"] + staging_rows(cfg, layout)


def remote_blocks(cfg: Config, layout: KVLayout) -> int:
    """Blocks the remote tier's capacity holds (each value is a header plus the block); an estimate for
    the plan and the residency filter's size: Redis's own maxmemory policy decides what it keeps."""
    return cfg.tiers.remote.capacity // (layout.bytes_per_block + REMOTE_HEADER_SIZE)


def plan(cfg: Config, layout: KVLayout | None = None) -> dict[str, Any]:
    """The scheduler's view: the same layout object gives every tier its slot count.

    Without a layout, the config's model geometry stands in for the engine's tensors.
    """
    if layout is None:
        layout = KVLayout.from_block_bytes(cfg.model.region_block_bytes(), cfg.gpu.num_blocks)
    bpb = layout.bytes_per_block
    tokens = cfg.model.block_tokens
    tiers: list[dict[str, Any]] = [
        {
            "tier": "gpu",
            "capacity_bytes": layout.num_blocks * bpb,
            "slots": layout.num_blocks,
            "tokens": layout.num_blocks * tokens,
        }
    ]
    for name, slots in tier_slots(cfg, layout).items():
        capacity = getattr(cfg.tiers, name).capacity
        tiers.append({"tier": name, "capacity_bytes": capacity, "slots": slots, "tokens": slots * tokens})
    if cfg.tiers.remote.enabled:
        blocks = remote_blocks(cfg, layout)
        tiers.append({"tier": "remote", "capacity_bytes": cfg.tiers.remote.capacity, "slots": blocks,
                      "tokens": blocks * tokens, "estimate": True})  # fmt: skip
    return {
        "model_id": cfg.model.model_id,
        "dtype": cfg.model.dtype,
        "block_tokens": tokens,
        "bytes_per_block": bpb,
        "regions": layout.num_regions,
        "layout_digest": layout.digest,
        "tiers": tiers,
    }


def render_plan(result: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # the core install has no rich (extra `cli`): plain text
        print(f"{result['model_id']} ({result['dtype']}): bytes_per_block = {result['bytes_per_block']} "
              f"({result['regions']} regions, {result['block_tokens']} tokens/block, layout {result['layout_digest']})")
        for t in result["tiers"]:
            print(f"{t['tier']:5} {format_size(t['capacity_bytes']):>12} {t['slots']:>12,} slots {t['tokens']:>14,} tokens")
        return
    console = Console()
    console.print(
        f"[bold]{result['model_id']}[/] ({result['dtype']}): bytes_per_block = [bold]{result['bytes_per_block']}[/] "
        f"({format_size(result['bytes_per_block'])}, {result['regions']} regions, "
        f"{result['block_tokens']} tokens/block, layout {result['layout_digest']})"
    )
    table = Table("tier", "capacity", "slots", "tokens")
    for t in result["tiers"]:
        table.add_row(t["tier"], format_size(t["capacity_bytes"]), f"{t['slots']:,}", f"{t['tokens']:,}")
    console.print(table)
