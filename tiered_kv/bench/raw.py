"""The raw references: the fastest correct batched copies of the same bytes in the same layout.

The layout is the cache's: one tensor per region on the engine side (rows =
blocks), one block-major slab on the CPU side whose region r is the strided
column view ``slab[:, off_r:off_r + region_bytes]``. A store gathers a batch of
scattered engine rows into a run of consecutive slab rows, a load scatters a
run back. Each direction has a few candidate implementations; the bench checks
every one copies the right bytes, times each on the case's own tensors and
keeps the fastest (see stats.interleave), so the reference is the best this
machine does, not one guess at it. ``finish`` waits for the copies (CUDA work is asynchronous).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import TieredKVError


@dataclass
class Batch:
    """One batch of engine block ids, as numpy (host) and as a tensor on the engine's device."""

    ids: np.ndarray
    ids_t: torch.Tensor
    ids_list: list[int]

    @classmethod
    def of(cls, ids: np.ndarray, device: torch.device) -> Batch:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return cls(ids, torch.from_numpy(ids).to(device), ids.tolist())


# A raw copy moves one batch: engine rows ``batch.ids`` <-> slab rows ``first .. first + len - 1``.
RawCopy = Callable[[Batch, int], None]


class RawCopies:
    """Candidate raw copies between engine region tensors and the slab's region views."""

    def __init__(self, gpu: Sequence[torch.Tensor], slab: torch.Tensor, offsets: Sequence[int], batch: int) -> None:
        self.gpu = list(gpu)
        self.slab = slab
        self.offsets = list(offsets)
        self.widths = [int(g.shape[1]) for g in self.gpu]
        self.cpu = [slab[:, o : o + w] for o, w in zip(self.offsets, self.widths, strict=True)]
        self.cuda = self.gpu[0].device.type == "cuda"
        if self.cuda:  # block-major staging on the device: the gather lands here, then one DMA per batch
            self.staging = torch.empty((batch, slab.shape[1]), dtype=torch.uint8, device=self.gpu[0].device)
        else:
            self.gpu_np = [g.numpy() for g in self.gpu]
            self.cpu_np = [c.numpy() for c in self.cpu]

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # -- candidates -------------------------------------------------------------------
    def store_candidates(self) -> dict[str, RawCopy]:
        if self.cuda:
            return {"device gather + 1 DMA": lambda b, a: self._cuda_store(b, a, wide=False),
                    "device gather (int64) + 1 DMA": lambda b, a: self._cuda_store(b, a, wide=True)}  # fmt: skip
        gpu, cpu, gpu_np, cpu_np = self.gpu, self.cpu, self.gpu_np, self.cpu_np

        def index_select(b: Batch, a: int) -> None:
            n = len(b.ids)
            for g, c in zip(gpu, cpu, strict=True):
                torch.index_select(g, 0, b.ids_t, out=c[a : a + n])

        def np_take(b: Batch, a: int) -> None:
            n = len(b.ids)
            for g, c in zip(gpu_np, cpu_np, strict=True):
                np.take(g, b.ids, axis=0, out=c[a : a + n])

        def np_fancy(b: Batch, a: int) -> None:
            n = len(b.ids)
            for g, c in zip(gpu_np, cpu_np, strict=True):
                c[a : a + n] = g[b.ids]

        return {"torch.index_select(out=)": index_select, "numpy.take(out=)": np_take, "numpy gather": np_fancy}

    def load_candidates(self) -> dict[str, RawCopy]:
        if self.cuda:
            return {"1 DMA + device scatter": lambda b, a: self._cuda_load(b, a, wide=False),
                    "1 DMA + device scatter (int64)": lambda b, a: self._cuda_load(b, a, wide=True)}  # fmt: skip
        gpu_np, cpu_np = self.gpu_np, self.cpu_np

        def np_scatter(b: Batch, a: int) -> None:
            n = len(b.ids)
            for g, c in zip(gpu_np, cpu_np, strict=True):
                g[b.ids] = c[a : a + n]

        def np_put_rows(b: Batch, a: int) -> None:  # scatter through a contiguous copy of the run
            n = len(b.ids)
            for g, c in zip(gpu_np, cpu_np, strict=True):
                g[b.ids] = np.ascontiguousarray(c[a : a + n])

        # torch's CPU index_copy_ walks elements (~5x slower here): not a candidate.
        return {"numpy scatter": np_scatter, "numpy contiguous + scatter": np_put_rows}

    def _cuda_store(self, b: Batch, a: int, *, wide: bool) -> None:
        n = len(b.ids)
        stage = self.staging[:n]
        for g, o, w in zip(self.gpu, self.offsets, self.widths, strict=True):
            src, dst = _widen(g, stage[:, o : o + w], wide)
            torch.index_select(src, 0, b.ids_t, out=dst)
        self.slab[a : a + n].copy_(stage, non_blocking=True)

    def _cuda_load(self, b: Batch, a: int, *, wide: bool) -> None:
        n = len(b.ids)
        stage = self.staging[:n]
        stage.copy_(self.slab[a : a + n], non_blocking=True)
        for g, o, w in zip(self.gpu, self.offsets, self.widths, strict=True):
            dst, src = _widen(g, stage[:, o : o + w], wide)
            dst.index_copy_(0, b.ids_t, src)

    # -- checks -----------------------------------------------------------------------
    def holds(self, slots: np.ndarray, b: Batch) -> bool:
        """Slab rows ``slots`` equal the engine rows ``b.ids``, region by region."""
        if not self.cuda:  # numpy: torch's CPU indexing would pay the intra-op thread start-up per region
            return all(np.array_equal(c[slots], g[b.ids]) for g, c in zip(self.gpu_np, self.cpu_np, strict=True))
        idx = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        return all(torch.equal(c[idx].to(g.device), g[b.ids_t]) for g, c in zip(self.gpu, self.cpu, strict=True))

    def checked(self, op: str, b: Batch, first: int) -> dict[str, RawCopy]:
        """The ``op`` ("store" or "load") candidates, each run once and checked (TieredKVError if wrong)."""
        candidates = self.store_candidates() if op == "store" else self.load_candidates()
        rows = self.slab[first : first + len(b.ids)]
        for name, fn in candidates.items():
            # The slab rows first get bytes that no engine row holds (engine rows are a random pattern), so a
            # store that did nothing fails, and so does a load, whose engine rows must now equal them.
            rows.fill_(0xA5 if op == "store" else 0x5A)
            fn(b, first)
            self.finish()
            if not self.holds(np.arange(first, first + len(b.ids)), b):
                raise TieredKVError(f"bench: the raw {op} candidate {name!r} copied the wrong bytes")
        return candidates


def _widen(g: torch.Tensor, cols: torch.Tensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 views of both sides when their widths and offsets allow (8x fewer elements for the index kernels)."""
    if wide and g.shape[1] % 8 == 0 and cols.storage_offset() % 8 == 0 and cols.stride(0) % 8 == 0:
        return g.view(torch.int64), cols.view(torch.int64)
    return g, cols
