"""The CPU tier's memory: one block-major slab, page-locked at its exact size.

``slab[slot]`` holds one whole block: region r at columns ``offsets[r] ..
offsets[r] + region_block_bytes[r]``. A run of consecutive slots is one
contiguous buffer, so a run of blocks is one DMA, one vectored disk write, or
one slice handed to a network client, whatever the number of regions.

``pin_memory=True`` rounds an allocation up to a power of two (vLLM #53042
measured 1.92x), so with CUDA we allocate plain page-aligned memory and register
exactly that range with ``cudaHostRegister``, in chunks of whole pages and rows
(see pinning.py), on the KV tensors' device.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ConfigError
from ..host_checks import mem_available
from ..layout import KVLayout
from ..sizes import format_size
from .pinning import HostRegistration, page_aligned_empty, pin_chunks, warn_if_memlock_low

log = logging.getLogger(__name__)
_warned_unpinned = False


class CpuSlabs:
    """``slab`` is ``uint8[num_slots, bytes_per_block]``; ``regions[r]`` its strided column view for region r.

    ``device``: the CUDA device the slab is pinned for (the KV tensors'); the
    registration runs with it current, whatever thread builds the slabs.
    ``dma_rows``: rows per registered chunk when there are several (a DMA must not
    cross a chunk edge, which falls between rows), else None.
    """

    def __init__(self, layout: KVLayout, num_slots: int, *, pin: str = "auto", pin_chunk: int = 1 << 30,
                 device: torch.device | None = None) -> None:  # fmt: skip
        self.num_slots = num_slots
        self.nbytes = num_slots * layout.bytes_per_block
        available = mem_available()
        if available is not None and self.nbytes > available:
            raise ConfigError(
                f"tiers.cpu.capacity: the CPU tier needs {self.nbytes} bytes ({format_size(self.nbytes)}) but only "
                f"{available} bytes ({format_size(available)}) are available"
            )
        want_pin = pin == "on" or (pin == "auto" and torch.cuda.is_available())
        if pin == "on" and not torch.cuda.is_available():
            raise ConfigError("tiers.cpu.pin_memory: 'on' needs CUDA, and torch.cuda.is_available() is False")
        self._buffer = page_aligned_empty(self.nbytes)
        self._registration = HostRegistration(device if device is not None and device.type == "cuda" else None)
        self.dma_rows: int | None = None
        self.bytes_per_block = layout.bytes_per_block
        if want_pin:
            self._pin(pin_chunk)
        else:
            _log_unpinned_once()
        self.slab = self._buffer.view(num_slots, layout.bytes_per_block)
        self.slab_np = self.slab.numpy()  # the same memory, for I/O (views are made once, here)
        self.offsets: list[int] = []
        self.regions: list[torch.Tensor] = []
        offset = 0
        for block_bytes in layout.region_block_bytes:
            self.offsets.append(offset)
            self.regions.append(self.slab[:, offset : offset + block_bytes])
            offset += block_bytes

    @property
    def pinned(self) -> bool:
        return bool(self._registration.ranges)

    def rows(self, first: int, count: int) -> memoryview:
        """Slots ``first .. first + count - 1`` as one writable buffer (for vectored I/O)."""
        return memoryview(self.slab_np[first : first + count]).cast("B")

    def _pin(self, chunk: int) -> None:
        warn_if_memlock_low(self.nbytes)
        chunks = pin_chunks(self.nbytes, max(1, self.bytes_per_block), max(chunk, 1 << 20))
        base = self._buffer.data_ptr()
        progress = _progress(self.nbytes) if len(chunks) >= 4 else None
        try:
            for start, size in chunks:
                self._registration.register(base + start, size, what=f"offset {start} of the {self.nbytes}-byte "
                                                                     "CPU tier")  # fmt: skip
                if progress is not None:
                    progress[0].update(progress[1], advance=size)
        except BaseException:
            self.release()
            raise
        finally:
            if progress is not None:
                progress[0].stop()
        if len(chunks) > 1:
            self.dma_rows = chunks[0][1] // max(1, self.bytes_per_block)

    def release(self) -> None:
        """Unregister pinned memory (idempotent); the slabs must not be used afterwards."""
        self._registration.release()


def _log_unpinned_once() -> None:
    global _warned_unpinned
    if not _warned_unpinned:
        _warned_unpinned = True
        log.info("CUDA is not available: the CPU tier uses plain (unpinned) memory")


def _progress(total: int):
    try:
        from rich.progress import Progress
    except ImportError:  # the core install has no rich: no progress bar
        return None

    bar = Progress(transient=True)
    task = bar.add_task("pinning CPU tier", total=total)
    bar.start()
    return bar, task
