"""Copy engines, the lowest layer of transfer/: copy whole KV blocks between GPU blocks and CPU slots.

host.py (CPU threads; numpy_rows.py its numpy-only variant), cuda.py (CUDA streams and events, with
the staged, table and table-kernel copy paths and the pinned index ring), bridge.py (CUDA event ->
asyncio), base.py (the interface they share).

``make_engine("auto", gpu_regions, cpu_regions)`` picks the CUDA stream engine
when the GPU regions live on CUDA, else the host (CPU thread) engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import torch

from ...config import EngineKind
from ...errors import ConfigError
from .base import CopyEngine, CopyHandle, Direction, validate_regions
from .cuda import CUDAStreamEngine
from .host import HostCopyEngine

ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)

__all__ = [
    "ENGINE_KINDS",
    "CUDAStreamEngine",
    "CopyEngine",
    "CopyHandle",
    "Direction",
    "HostCopyEngine",
    "make_engine",
    "validate_regions",
]


def make_engine(
    kind: str, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor], *,
    dma_rows: int | None = None,
) -> CopyEngine:  # fmt: skip
    """Build the copy engine named by ``kind`` ("auto" | "host" | "cuda").

    ``dma_rows``: rows per registered chunk of a pinned slab (``CpuSlabs.dma_rows``), for the CUDA engine.
    """
    if kind == "auto":
        on_cuda = bool(gpu_regions) and gpu_regions[0].device.type == "cuda"
        kind = "cuda" if on_cuda else "host"
    if kind == "host":
        return HostCopyEngine(gpu_regions, cpu_regions)
    if kind == "cuda":
        return CUDAStreamEngine(gpu_regions, cpu_regions, dma_rows=dma_rows)
    raise ConfigError(f"transfer engine kind must be one of {', '.join(ENGINE_KINDS)}; got {kind!r}")
