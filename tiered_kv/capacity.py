"""Capacity planning: bytes per block, slots and tokens per tier, from a config alone."""

from __future__ import annotations

from typing import Any

from .config import Config
from .layout import KVLayout
from .sizes import format_size


def plan(cfg: Config) -> dict[str, Any]:
    """The scheduler's view: the same layout object gives every tier its slot count."""
    layout = KVLayout.from_block_bytes(cfg.model.region_block_bytes(), cfg.gpu.num_blocks)
    bpb = layout.bytes_per_block
    tokens = cfg.model.block_tokens
    tiers: list[dict[str, Any]] = [
        {
            "tier": "gpu",
            "capacity_bytes": cfg.gpu.num_blocks * bpb,
            "slots": cfg.gpu.num_blocks,
            "tokens": cfg.gpu.num_blocks * tokens,
        }
    ]
    for name, tier_cfg, enabled in (
        ("cpu", cfg.tiers.cpu, True),
        ("disk", cfg.tiers.disk, cfg.tiers.disk.enabled),
    ):
        if not enabled:
            continue
        slots = layout.slots_for(tier_cfg.capacity)
        tiers.append({"tier": name, "capacity_bytes": tier_cfg.capacity, "slots": slots, "tokens": slots * tokens})
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
    from rich.console import Console
    from rich.table import Table

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
