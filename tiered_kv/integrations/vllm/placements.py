"""Where vLLM 0.32 puts each layer's pages, read from ``kv_cache_config.kv_cache_tensors``: never guessed.

A ``KVCacheTensor`` places ``layers[l]``'s page of block ``b`` at ``offset + l * layer_stride + b *
block_stride`` of the one backing allocation of ``size`` logical bytes. Two shapes follow from it:

- **layer-outermost** (LBHNC and kin): each layer owns a region of ``num_blocks`` pages of
  ``block_stride`` bytes (its page padded to its alignment); a block id owns one page in each
  distinct region. Groups overlay each other from byte 0, so regions are counted once by address.
- **block-outermost** (BLHNC, BLNHC, BHLNC; DeepSeek-V4 always; hybrid models with cross-layer
  blocks): block ``b`` is one row ``[b * block_stride, (b + 1) * block_stride)`` holding a page of
  every layer (and, overlaid, of every group), pages padded inside the row. A block id then owns its
  whole row, and tiered_kv stores the row: one contiguous copy per run of block ids, the bytes a hit
  of any group needs, and the same slot size for every group (docs/vllm.md, "Packed layouts").

The views over a storage are bounded by the logical size (``num_blocks`` rows or pages, never
``storage.nbytes()``), so a padded allocation (ROCm rounds up to 4 KiB) gives the same figures, and
padding of a whole row or more is never a row. Duck-typed: only attributes are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import LayoutError

if TYPE_CHECKING:
    import torch


def _starts(t: Any) -> list[tuple[str, int]]:
    offset, layer_stride = int(getattr(t, "offset", 0) or 0), int(t.layer_stride)
    return [(name, offset + i * layer_stride) for i, name in enumerate(t.layers)]


def _placed(kv_cache_config: Any) -> list[Any]:
    """The tensors with placements (vLLM 0.32+); ``[]`` for an older config (one allocation per tensor)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    placed = [t for t in tensors if getattr(t, "block_stride", None) is not None]
    if placed and len(placed) != len(tensors):
        raise LayoutError("kv_cache_config: some KV cache tensors carry placements (block_stride) and some do not")
    return placed


def packed_row_bytes(kv_cache_config: Any) -> int | None:
    """The packed block's bytes when the placements are block-outermost; None when layer-outermost.

    A tensor says it is packed when its layers sit side by side inside a block (``layer_stride <
    block_stride``: a layer-outermost layer's region is ``num_blocks`` pages) or its first page starts
    inside block 0's row (``0 < offset < block_stride``). Then every tensor must be packed the same way: one ``block_stride``, and every
    layer's page starting inside the row; anything else is refused with the numbers.
    """
    placed = _placed(kv_cache_config)
    signals = [t for t in placed if 0 < int(t.layer_stride) < int(t.block_stride)
               or 0 < int(getattr(t, "offset", 0) or 0) < int(t.block_stride)]  # fmt: skip
    if not signals:
        return None
    row = int(signals[0].block_stride)
    for t in placed:
        if int(t.block_stride) != row:
            raise LayoutError(
                f"kv_cache_config: tensor of layers {list(t.layers)[:2]} has block_stride {t.block_stride} but the "
                f"packed (block-outermost) block of {list(signals[0].layers)[:2]} is {row} bytes: a block id must own "
                "one row"
            )
        for name, start in _starts(t):
            if not 0 <= start < row:
                raise LayoutError(
                    f"kv_cache_config: layer {name!r} starts at byte {start} of a packed block of {row} bytes "
                    f"(offset {getattr(t, 'offset', 0)}, layer_stride {t.layer_stride}): outside its block's row"
                )
    return row


def block_pages(kv_cache_config: Any) -> dict[int, int]:
    """Every distinct page start (of block 0) in the backing allocation -> the bytes a block id owns there.

    Layer-outermost: each distinct layer region's page (regions that overlay are counted once, by
    address: a block id owns the same pages whichever group holds it). Block-outermost: the one row at
    byte 0. Configs before placements give each tensor its own ``size``.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    if not _placed(kv_cache_config):
        return {i * (1 << 62): int(t.size) // num_blocks for i, t in enumerate(kv_cache_config.kv_cache_tensors)}
    row = packed_row_bytes(kv_cache_config)
    if row is not None:
        return {0: row}
    pages: dict[int, int] = {}
    for t in kv_cache_config.kv_cache_tensors:
        for _, start in _starts(t):
            if pages.setdefault(start, int(t.block_stride)) != int(t.block_stride):
                raise LayoutError(f"kv_cache_config: two layers start at byte {start} with different page sizes")
    return pages


def layer_pages(kv_cache_config: Any, layers: Any) -> int:
    """Bytes per block of the pages ``layers`` use (what one group's block holds, for reports).

    A packed layer's page is its ``layer_stride`` (the padded page), cut at the end of the row."""
    wanted = set(layers)
    row = packed_row_bytes(kv_cache_config)
    pages: dict[int, int] = {}
    for t in _placed(kv_cache_config):
        for name, start in _starts(t):
            if name in wanted:
                stride = int(t.layer_stride)
                page = int(t.block_stride) if row is None else min(stride if stride > 0 else row, row - start)
                pages[start] = page
    return sum(pages.values())


def block_dims(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> dict[str, int]:
    """For each dense layer view, the dim that counts blocks as the placements say: the one dim of
    ``num_blocks`` entries whose stride is the layer's ``block_stride``. A tensor where that is not exactly
    one dim is left out (KVLayout then decides, or refuses). This settles views where another dim also
    equals ``num_blocks`` (``[64, 2, 32, 64]`` with 64 blocks)."""
    num_blocks = int(kv_cache_config.num_blocks)
    strides = {name: int(t.block_stride) for t in _placed(kv_cache_config) for name in t.layers}
    out: dict[str, int] = {}
    for name, tensor in kv_caches.items():
        stride = strides.get(name)
        if stride is None or not hasattr(tensor, "stride"):
            continue
        dims = [d for d, n in enumerate(tensor.shape)
                if n == num_blocks and tensor.stride(d) * tensor.element_size() == stride]  # fmt: skip
        if len(dims) == 1:
            out[name] = dims[0]
    return out


def placement_views(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """One byte view ``[num_blocks, bytes]`` per distinct page start (a layer region, or the packed row),
    over the backing allocation the engine's views live on: what a block id owns, whatever a layer's own
    view looks like (a Mamba layer's states are strided views of a padded page; a packed layer's view
    skips the other layers' pages; a layer without views is the raw buffer)."""
    import torch

    first = next(iter(kv_caches.values()))
    first = first[0] if isinstance(first, (list, tuple)) else first
    storage = first.untyped_storage()
    num_blocks = int(kv_cache_config.num_blocks)
    names: dict[int, str] = {}
    for t in kv_cache_config.kv_cache_tensors:
        for name, start in _starts(t):
            names.setdefault(start, name)
    pages = block_pages(kv_cache_config)
    if packed_row_bytes(kv_cache_config) is not None:  # the row is named by the first layer placed
        names[0] = next(n for t in kv_cache_config.kv_cache_tensors for n, _ in _starts(t))
    views: dict[str, torch.Tensor] = {}
    for start, page in sorted(pages.items()):
        if start + num_blocks * page > storage.nbytes():
            raise LayoutError(f"kv_cache_config places a layer at bytes {start}..{start + num_blocks * page} of a "
                              f"backing allocation of {storage.nbytes()} bytes")  # fmt: skip
        view = torch.empty(0, dtype=torch.uint8, device=first.device)
        view.set_(storage, start, (num_blocks, page), (page, 1))
        views[names[start]] = view
    return views
