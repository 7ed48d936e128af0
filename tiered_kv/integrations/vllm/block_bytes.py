"""One bytes-per-block on both sides: the scheduler's figure from ``kv_cache_config``, each rank's from its tensors.

vLLM's ``kv_cache_config`` (the same object in the scheduler and in every worker)
names each backing allocation's *logical* size. The scheduler's per-rank bytes per
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

if TYPE_CHECKING:
    import torch


def _pages(kv_cache_config: Any) -> dict[int, int]:
    """Every distinct layer page start in the backing allocation -> its bytes per block.

    vLLM 0.32's ``KVCacheTensor`` places ``layers[l]``'s block ``b`` at ``offset + l * layer_stride +
    b * block_stride`` of the one backing allocation of ``size`` bytes; under the hybrid allocator the
    groups overlay each other, so several tensors name the same bytes. Deduplicated by address here:
    a block id owns the same pages whichever group holds it. Older configs (no placement) give each
    tensor its own ``size``.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    pages: dict[int, int] = {}
    for t in kv_cache_config.kv_cache_tensors:
        block_stride = getattr(t, "block_stride", None)
        if block_stride is None:  # one allocation per tensor (vLLM before placements)
            pages[len(pages) * (1 << 62)] = int(t.size) // num_blocks
            continue
        layer_stride, offset = int(t.layer_stride), int(getattr(t, "offset", 0) or 0)
        if int(block_stride) > layer_stride and len(t.layers) > 1:
            raise LayoutError(
                f"kv_cache_config: tensor of layers {list(t.layers)[:2]}... is block-outermost (block_stride "
                f"{block_stride} > layer_stride {layer_stride}): tiered_kv views each layer's pages as one "
                "region of num_blocks pages; this packed layout is not supported"
            )
        for layer in range(len(t.layers)):
            start = offset + layer * layer_stride
            if pages.setdefault(start, int(block_stride)) != int(block_stride):
                raise LayoutError(f"kv_cache_config: two layers start at byte {start} with different page sizes")
    return pages


def scheduler_bytes_per_block(kv_cache_config: Any) -> int:
    """Per-rank bytes per block as the scheduler plans it: the distinct pages one block id owns."""
    num_blocks = int(kv_cache_config.num_blocks)
    if num_blocks <= 0:
        raise LayoutError(f"kv_cache_config: num_blocks is {num_blocks}")
    per_block = sum(_pages(kv_cache_config).values())
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
    wanted = set(layers)
    pages: dict[int, int] = {}
    for t in kv_cache_config.kv_cache_tensors:
        if getattr(t, "block_stride", None) is None:
            continue
        for layer, name in enumerate(t.layers):
            if name in wanted:
                pages[int(getattr(t, "offset", 0) or 0) + layer * int(t.layer_stride)] = int(t.block_stride)
    return sum(pages.values())


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
    if any(not _dense(t) for t in kv_caches.values()):  # e.g. Mamba state: strided views of padded pages
        kv_caches = placement_views(kv_caches, kv_cache_config)
    layout = KVLayout.from_tensors(kv_caches, int(kv_cache_config.num_blocks),
                                   logical_sizes(kv_cache_config, kv_caches) or None,
                                   block_tokens=block_tokens)  # fmt: skip
    check_rank_bytes(layout.bytes_per_block, scheduler_bytes_per_block(kv_cache_config), rank=None)
    return layout


def _dense(t: Any) -> bool:
    return hasattr(t, "is_contiguous") and t.is_contiguous()


def placement_views(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """One byte view ``[num_blocks, page]`` per distinct page start of kv_cache_config's placements, over
    the backing allocation the engine's views live on: what a block id owns, whatever a layer's own
    view looks like (a Mamba layer's conv and SSM states are strided views of a padded page)."""
    import torch

    first = next(iter(kv_caches.values()))
    first = first[0] if isinstance(first, (list, tuple)) else first
    storage = first.untyped_storage()
    num_blocks = int(kv_cache_config.num_blocks)
    names: dict[int, str] = {}
    for t in kv_cache_config.kv_cache_tensors:
        for layer, name in enumerate(t.layers):
            names.setdefault(int(getattr(t, "offset", 0) or 0) + layer * int(t.layer_stride), name)
    views: dict[str, torch.Tensor] = {}
    for start, page in sorted(_pages(kv_cache_config).items()):
        if start + num_blocks * page > storage.nbytes():
            raise LayoutError(f"kv_cache_config places a layer at bytes {start}..{start + num_blocks * page} of a "
                              f"backing allocation of {storage.nbytes()} bytes")  # fmt: skip
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(storage, start, (num_blocks, page), (page, 1))
        views[names[start]] = view
    return views


def check_rank_bytes(worker: int, scheduler: int, *, rank: int | None) -> None:
    if worker != scheduler:
        who = "this worker" if rank is None else f"TP rank {rank}"
        raise LayoutError(
            f"{who} has {worker} bytes per KV block (its registered tensors, bounded by kv_cache_config's logical "
            f"sizes) but the scheduler planned {scheduler} bytes per block per rank from kv_cache_config: refusing "
            "to start, a CPU slot would hold the wrong bytes"
        )
