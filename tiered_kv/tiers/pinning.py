"""Page-locking the CPU tier: a page-aligned buffer, registered in whole-row chunks with cudaHostRegister.

``cudaHostRegister`` page-locks whole pages: a range that starts or ends inside a
page locks all of it. torch's CPU allocator returns large buffers 64 bytes past
a page boundary, so chunk k's first page was already locked by chunk k-1 and the
call fails with 712 (``cudaErrorHostMemoryAlreadyRegistered``). Hence: the buffer
starts on a page and owns its last page, and every chunk is a multiple of
lcm(page, bytes per row), so chunk edges fall on pages *and* between rows (a
copy engine can split a DMA at a chunk edge; see ``CpuSlabs.dma_rows``).

The memlock limit is only a warning: the NVIDIA driver's page-locking is not
charged to ``RLIMIT_MEMLOCK`` (Docker's default of 64 KiB would otherwise refuse
every CPU tier), so the registration's result decides, and its error says what
to try.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import resource
from typing import Any

import numpy as np
import torch

from ..errors import PinningError

log = logging.getLogger(__name__)
PAGE = max(4096, mmap.PAGESIZE)


def page_aligned_empty(nbytes: int, page: int = PAGE) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose *storage* starts on a page and owns whole pages.

    Not a view into a larger tensor: torch's ``is_pinned()`` asks CUDA about the storage's first byte,
    which for such a view lies in the unregistered page before it, so a registered slab would be
    reported unpinned (and CUDAStreamEngine refuses unpinned memory). The aligned numpy view becomes
    the tensor's own storage (``torch.from_numpy``), which keeps the larger allocation alive.
    """
    padded = max(page, -(-nbytes // page) * page)
    raw = np.empty(padded + page, dtype=np.uint8)
    skip = (-raw.ctypes.data) % page
    storage = torch.from_numpy(raw[skip : skip + padded])
    return storage[:nbytes]


def pin_chunks(nbytes: int, row_bytes: int, chunk: int, page: int = PAGE) -> list[tuple[int, int]]:
    """``(offset, size)`` of each registration: they tile ``[0, nbytes)`` in order, without overlap.

    Every offset is a multiple of lcm(page, row_bytes) (so every chunk but the
    last is a whole number of pages and of rows); chunks are the largest such
    multiple not above ``chunk``, or one unit when ``chunk`` is smaller than it.
    """
    if row_bytes < 1 or chunk < 1 or page < 1 or nbytes < 0:
        raise PinningError(f"pin_chunks: need nbytes >= 0 and positive sizes, got {nbytes=} {row_bytes=} "
                           f"{chunk=} {page=}")  # fmt: skip
    unit = math.lcm(page, row_bytes)
    step = max(unit, chunk // unit * unit)
    return [(offset, min(step, nbytes - offset)) for offset in range(0, nbytes, step)]


def device_guard(device: torch.device | None) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` for a CUDA device, else nothing: a CUDA call on a thread whose
    current device is another GPU's would create a context (about 0.5 GiB) on that GPU."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def warn_if_memlock_low(nbytes: int) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and nbytes > soft:
        log.warning("RLIMIT_MEMLOCK is %d bytes, below the CPU tier's %d: pinning anyway (the NVIDIA driver's "
                    "page-locking is not charged to it); if cudaHostRegister fails, raise the limit", soft, nbytes)  # fmt: skip


class HostRegistration:
    """Ranges page-locked with ``cudaHostRegister`` on one device; ``release`` unregisters them all."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self.ranges: list[tuple[int, int]] = []
        self._cudart: Any = None

    def register(self, ptr: int, size: int, *, what: str) -> None:
        with device_guard(self.device):
            cudart = self._cudart = self._cudart or torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(ptr, size, 0))
            if err:
                _clear_last_error(cudart)  # else the next torch CUDA call on this thread reports it as its own
                raise PinningError(_register_failed(cudart, err, size, what))
        self.ranges.append((ptr, size))

    def release(self) -> None:
        if not self.ranges:
            return
        with device_guard(self.device):
            for ptr, _size in self.ranges:
                err = int(self._cudart.cudaHostUnregister(ptr))
                if err:
                    _clear_last_error(self._cudart)
                    log.error("cudaHostUnregister of %#x failed with CUDA error %d", ptr, err)
        self.ranges.clear()


def _register_failed(cudart: Any, err: int, size: int, what: str) -> str:
    try:
        name = f" ({cudart.cudaGetErrorString(err)})"
    except Exception:  # torch's binding wants its enum type; the number is enough
        name = ""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return (f"cudaHostRegister of {size} bytes ({what}) failed with CUDA error {err}{name}. RLIMIT_MEMLOCK is "
            f"{limit}: if the error is about memory or permissions, raise it (`ulimit -l unlimited`, memlock in "
            f"/etc/security/limits.conf, or the container's --ulimit memlock=-1), or lower tiers.cpu.capacity; "
            f"tiers.cpu.pin_memory: off runs without pinning (slower copies)")  # fmt: skip


def _clear_last_error(cudart: Any) -> None:
    """Reset the CUDA runtime's per-thread last error (torch's cudart binding has no cudaGetLastError)."""
    get_last_error = getattr(cudart, "cudaGetLastError", None) or _libcudart_get_last_error()
    if get_last_error is not None:
        get_last_error()


def _libcudart_get_last_error() -> Any:
    """``cudaGetLastError`` of the libcudart this process already loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
        for path in sorted(paths):
            return ctypes.CDLL(path).cudaGetLastError  # the loaded library: dlopen returns its handle
    except (OSError, AttributeError):
        pass
    return None
