"""Copy engines, the lowest layer of transfer/: copy whole KV blocks between GPU blocks and CPU slots.

host.py (CPU threads; numpy_rows.py its numpy-only variant), cuda.py (CUDA streams and events, with
the staged, table and table-kernel copy paths and the pinned index ring), direct.py (the direct road:
GPU rows straight to slab rows, one native submit per call), bridge.py (CUDA event -> asyncio),
base.py (the interface they share).

``make_engine("auto", gpu_regions, cpu_regions)`` picks a CUDA engine (``cuda_engine``: the direct road
where the layout allows it, else the CUDA stream engine) when the GPU regions live on CUDA, else the
host (CPU thread) engine. It is the one factory: the cache's engine and the worker's ShardCopier's
(``counted=True``: an engine with base.CountedCopies' loop-free copies, counted.py) both come from it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import get_args

import torch

from ...config import EngineKind
from ...errors import ConfigError, TransferError
from .base import (
    CopyEngine,
    CopyHandle,
    CountedCopies,
    Direction,
    InlineCopies,
    NowCopies,
    ThreadedCopies,
    validate_regions,
)
from .counted import CountedDirectEngine, CountedRowEngine
from .cuda import CUDAStreamEngine
from .direct import DirectCopyEngine, direct_eligible
from .host import HostCopyEngine
from .table import PATH_ENV

log = logging.getLogger(__name__)

ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)

__all__ = [
    "ENGINE_KINDS",
    "CUDAStreamEngine",
    "CopyEngine",
    "CopyHandle",
    "CountedCopies",
    "CountedDirectEngine",
    "CountedRowEngine",
    "Direction",
    "DirectCopyEngine",
    "HostCopyEngine",
    "InlineCopies",
    "NowCopies",
    "ThreadedCopies",
    "cuda_engine",
    "make_engine",
    "validate_regions",
]


def make_engine(
    kind: str, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor], *,
    dma_rows: int | None = None, counted: bool = False,
) -> CopyEngine:  # fmt: skip
    """Build the copy engine named by ``kind`` ("auto" | "host" | "cuda").

    ``dma_rows``: rows per registered chunk of a pinned slab (``CpuSlabs.dma_rows``), for the CUDA engine.
    ``counted``: an engine that is also a ``CountedCopies`` (no event loop: the worker's ShardCopier); on
    the host its copies always run on its worker threads, never inline on the caller's.
    """
    if kind == "auto":
        on_cuda = bool(gpu_regions) and gpu_regions[0].device.type == "cuda"
        kind = "cuda" if on_cuda else "host"
    if kind == "host":
        return (CountedRowEngine if counted else HostCopyEngine)(gpu_regions, cpu_regions)
    if kind == "cuda":
        return cuda_engine(gpu_regions, cpu_regions, dma_rows=dma_rows, counted=counted)
    raise ConfigError(f"transfer engine kind must be one of {', '.join(ENGINE_KINDS)}; got {kind!r}")


# "auto" picks the direct road only once a GPU run has measured it (issue 46): until then it is opt-in,
# ``copy_path="direct"`` or ``TIERED_KV_COPY_PATH=direct``, and never runs untested in front of users.
AUTO_DIRECT = False


def cuda_engine(
    gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor], *, dma_rows: int | None = None,
    copy_path: str = "auto", counted: bool = False,
) -> CopyEngine:  # fmt: skip
    """The CUDA engine for these regions, its copy path chosen once here (``engine.copy_path``).

    ``direct`` (direct.py): every GPU region straight to the slab (one region per block id, or rows of at least
    1 MiB); chosen by "auto" only when ``AUTO_DIRECT`` (off until measured on a GPU). Else ``CUDAStreamEngine``
    and its paths, exactly as before. ``copy_path`` (or ``$TIERED_KV_COPY_PATH`` when it is "auto") may force
    ``direct`` (any layout with adjacent bytes per row) or name one of the CUDA stream engine's paths.
    ``counted``: the direct road's engine is ``CountedDirectEngine`` (the stream engine is a CountedCopies itself).
    """
    direct = CountedDirectEngine if counted else DirectCopyEngine
    requested = copy_path if copy_path != "auto" else (os.environ.get(PATH_ENV, "") or "auto")
    if requested == "direct":
        if not direct_eligible(gpu_regions, cpu_regions, min_row=0):
            raise ConfigError("copy path 'direct' needs GPU rows whose bytes are adjacent and CPU slab rows "
                              "it can address; use auto")  # fmt: skip
        return direct(gpu_regions, cpu_regions, dma_rows=dma_rows)
    if requested == "auto" and AUTO_DIRECT and direct_eligible(gpu_regions, cpu_regions):
        try:
            return direct(gpu_regions, cpu_regions, dma_rows=dma_rows)
        except TransferError as exc:  # e.g. a driver without an entry the copier needs: the staged paths
            log.warning("direct copy path unavailable (%s); using the CUDA stream engine", exc)
    return CUDAStreamEngine(gpu_regions, cpu_regions, dma_rows=dma_rows, copy_path=copy_path)
