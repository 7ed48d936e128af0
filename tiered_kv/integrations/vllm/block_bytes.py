"""One bytes-per-block on both sides: the scheduler's figure from ``kv_cache_config``, each rank's from its tensors.

vLLM's ``kv_cache_config`` (the same object in the scheduler and in every worker)
names each backing allocation's *logical* size and where each layer's pages lie in it
(placements.py: layer-outermost regions, or block-outermost packed rows). The scheduler's per-rank bytes per
block is their sum over ``num_blocks``; a worker views its registered tensors
bounded by those same logical sizes (never the storage's padded size), so a
padded allocation gives the same figure, and a worker whose figure differs
refuses to start, naming both numbers. Duck-typed: reads only attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import LayoutError
from ...layout import KVLayout
from .placements import block_dims, block_pages, layer_pages, packed_row_bytes, placement_views

if TYPE_CHECKING:
    import torch


def scheduler_bytes_per_block(kv_cache_config: Any) -> int:
    """Per-rank bytes per block as the scheduler plans it: the distinct pages one block id owns."""
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        raise LayoutError(f"kv_cache_config: num_blocks is {num_blocks}")
    per_block = sum(block_pages(kv_cache_config).values())
    sizes = {int(t.size) for t in kv_cache_config.kv_cache_tensors}
    if all(getattr(t, "block_stride", None) is not None for t in kv_cache_config.kv_cache_tensors) \
            and sizes != {per_block * num_blocks}:  # fmt: skip
        raise LayoutError(
            f"kv_cache_config: the layers' distinct pages make {per_block} bytes per block, {per_block * num_blocks} "
            f"bytes over {num_blocks} blocks, but the backing allocation is {sorted(sizes)} bytes"
        )
    return per_block


def group_bytes_per_block(kv_cache_config: Any, layers: Any) -> int:
    """Bytes per block of the pages a group's layers use (at most the whole block's)."""
    return layer_pages(kv_cache_config, layers)


def logical_sizes(kv_cache_config: Any, kv_caches: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """The logical size of each backing allocation, named by one of the layers on it."""
    sizes: dict[str, int] = {}
    for t in kv_cache_config.kv_cache_tensors:
        layers = getattr(t, "layers", None) or getattr(t, "shared_by", None) or []
        name = next((n for n in layers if n in kv_caches), None)
        if name is not None:
            sizes[name] = int(t.size)
    return sizes


def worker_layout(kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any, block_tokens: int) -> KVLayout:
    """This rank's bound layout; LayoutError naming both figures if it disagrees with the scheduler's."""
    dims: dict[str, int] | None = None
    if packed_row_bytes(kv_cache_config) is not None or any(not _dense(t) for t in kv_caches.values()):
        # Packed rows, or views that are not whole pages (Mamba states are strided views of padded pages):
        # one view per distinct page start, as the placements say.
        kv_caches = placement_views(kv_caches, kv_cache_config)
    else:  # the engine's own views, with the block dim the placements name (never guessed)
        dims = block_dims(kv_caches, kv_cache_config) or None
    layout = KVLayout.from_tensors(kv_caches, int(kv_cache_config.num_blocks),
                                   logical_sizes(kv_cache_config, kv_caches) or None,
                                   block_dim=dims, block_tokens=block_tokens)  # fmt: skip
    check_rank_bytes(layout.bytes_per_block, scheduler_bytes_per_block(kv_cache_config), rank=None)
    return layout


def _dense(t: Any) -> bool:
    return hasattr(t, "is_contiguous") and t.is_contiguous()


def check_rank_bytes(worker: int, scheduler: int, *, rank: int | None) -> None:
    if worker != scheduler:
        who = "this worker" if rank is None else f"TP rank {rank}"
        raise LayoutError(
            f"{who} has {worker} bytes per KV block (its registered tensors, bounded by kv_cache_config's logical "
            f"sizes) but the scheduler planned {scheduler} bytes per block per rank from kv_cache_config: refusing "
            "to start, a CPU slot would hold the wrong bytes"
        )
