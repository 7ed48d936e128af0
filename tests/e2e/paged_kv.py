"""The engine side: paged KV tensors in the layouts real engines allocate.

Every layout exposes the same per-layer page views, K and V each
[num_blocks, block_tokens, kv_heads, head_dim], whatever the allocation
behind them: separate tensors, one fused [num_blocks, 2, ...] tensor per layer,
K and V stacked ahead of the block dim ([2, num_blocks, ...], declared), or
typed views carved out of raw byte buffers padded past their logical size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import tiered_kv as tkv

LAYOUTS = ("separate", "fused", "stacked", "padded", "padded_pool")
PAD_ALIGN = 4096  # allocators round KV allocations up to 4 KiB (vLLM)


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    num_blocks: int
    dtype: torch.dtype

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one K (or V) tensor."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.layers * 2 * self.page_bytes


@dataclass
class PagedKV:
    geo: Geometry
    kv_caches: dict[str, torch.Tensor]  # what the engine registers with tiered_kv
    k_pages: list[torch.Tensor]
    v_pages: list[torch.Tensor]
    raw: list[torch.Tensor]  # uint8 views of each whole (physical) allocation
    logical_sizes: list[int] | None = None
    pads: list[torch.Tensor] = field(default_factory=list)  # uint8 views of the bytes past logical
    block_dim: int | None = None  # declared when dim 0 does not count blocks

    def layout(self) -> tkv.KVLayout:
        return tkv.KVLayout.from_tensors(
            self.kv_caches,
            num_blocks=self.geo.num_blocks,
            logical_sizes=self.logical_sizes,
            block_dim=self.block_dim,
            block_tokens=self.geo.block_tokens,
        )

    def pages(self) -> list[torch.Tensor]:
        return [p for kv in zip(self.k_pages, self.v_pages, strict=True) for p in kv]

    def scribble(self, gen: torch.Generator, block_ids: list[int] | None = None) -> None:
        """Fill whole allocations (padding included) or just some blocks with random bytes."""
        if block_ids is None:
            for buf in self.raw:
                buf.copy_(_random_bytes(buf.numel(), gen).view(buf.shape))
            return
        for pages in self.pages():
            for b in block_ids:
                page = pages[b].view(torch.uint8)
                page.copy_(_random_bytes(page.numel(), gen).view(page.shape))

    def write_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> None:
        """Scatter [1, kv_heads, seq, head_dim] K/V into the pages of ``block_ids``, in order."""
        for layer, pair in enumerate(kv):
            for pages, t in zip((self.k_pages[layer], self.v_pages[layer]), pair, strict=True):
                pages[block_ids] = _to_pages(t, self.geo)

    def read_prefix(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Gather the pages of ``block_ids`` back into the model's [1, kv_heads, seq, head_dim]."""
        n = len(block_ids) * self.geo.block_tokens
        out = []
        for kp, vp in zip(self.k_pages, self.v_pages, strict=True):
            k, v = (p[block_ids].reshape(n, self.geo.kv_heads, self.geo.head_dim) for p in (kp, vp))
            out.append(
                (k.permute(1, 0, 2).unsqueeze(0).contiguous(), v.permute(1, 0, 2).unsqueeze(0).contiguous())
            )
        return out

    def page_bytes(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The raw bytes of every K/V page of ``block_ids``, one tensor per page tensor."""
        return [pages[block_ids].contiguous().view(torch.uint8).clone() for pages in self.pages()]

    def padding(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.pads]


def _random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _to_pages(t: torch.Tensor, geo: Geometry) -> torch.Tensor:
    # [1, kv_heads, seq, head_dim] -> [seq // block_tokens, block_tokens, kv_heads, head_dim]
    seq = t.shape[2]
    return (
        t[0].permute(1, 0, 2).reshape(seq // geo.block_tokens, geo.block_tokens, geo.kv_heads, geo.head_dim)
    )


def _padded(logical: int) -> int:
    """The next 4 KiB boundary strictly above ``logical``: there is always some padding."""
    return (logical // PAD_ALIGN + 1) * PAD_ALIGN


def _typed(buf: torch.Tensor, offset: int, geo: Geometry) -> torch.Tensor:
    region = geo.num_blocks * geo.page_bytes
    return buf[offset : offset + region].view(geo.dtype).view(geo.page_shape)


def make_paged(kind: str, geo: Geometry, device: str = "cpu") -> PagedKV:
    """Allocate the engine's KV tensors in layout ``kind`` (one of LAYOUTS)."""
    if kind == "separate":
        kv = {
            f"layer{i}.{t}": torch.empty(geo.page_shape, dtype=geo.dtype, device=device)
            for i in range(geo.layers)
            for t in "kv"
        }
        ks = [kv[f"layer{i}.k"] for i in range(geo.layers)]
        vs = [kv[f"layer{i}.v"] for i in range(geo.layers)]
        return PagedKV(geo, kv, ks, vs, [t.view(torch.uint8) for t in kv.values()])
    if kind == "fused":
        nb, *rest = geo.page_shape
        kv = {
            f"layer{i}": torch.empty((nb, 2, *rest), dtype=geo.dtype, device=device)
            for i in range(geo.layers)
        }
        fused = list(kv.values())
        return PagedKV(
            geo, kv, [t[:, 0] for t in fused], [t[:, 1] for t in fused], [t.view(torch.uint8) for t in fused]
        )
    if kind == "stacked":  # [2, num_blocks, ...] per layer: K then V, so blocks count on dim 1
        kv = {
            f"layer{i}": torch.empty((2, *geo.page_shape), dtype=geo.dtype, device=device)
            for i in range(geo.layers)
        }
        both = list(kv.values())
        raw = [t.view(torch.uint8) for t in both]
        return PagedKV(geo, kv, [t[0] for t in both], [t[1] for t in both], raw, block_dim=1)
    region = geo.num_blocks * geo.page_bytes
    if kind == "padded":  # one raw byte allocation per layer, K then V, padded past its logical size
        logical = 2 * region
        bufs = [torch.empty(_padded(logical), dtype=torch.uint8, device=device) for _ in range(geo.layers)]
        ks = [_typed(b, 0, geo) for b in bufs]
        vs = [_typed(b, region, geo) for b in bufs]
        sizes = [logical] * geo.layers
    elif kind == "padded_pool":  # one raw byte allocation for every layer's K and V
        logical = 2 * geo.layers * region
        bufs = [torch.empty(_padded(logical), dtype=torch.uint8, device=device)]
        ks = [_typed(bufs[0], 2 * i * region, geo) for i in range(geo.layers)]
        vs = [_typed(bufs[0], (2 * i + 1) * region, geo) for i in range(geo.layers)]
        sizes = [logical]
    else:
        raise ValueError(f"unknown layout {kind!r}; choose one of {LAYOUTS}")
    kv = {}
    for i in range(geo.layers):
        kv[f"layer{i}.k"], kv[f"layer{i}.v"] = ks[i], vs[i]
    pads = [b[logical:] for b in bufs]
    return PagedKV(geo, kv, ks, vs, bufs, sizes, pads)
