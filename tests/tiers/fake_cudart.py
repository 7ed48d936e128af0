"""A stand-in for ``torch.cuda.cudart()`` on CPU-only machines: page-granular, as the driver is.

``cudaHostRegister`` locks every page the range touches and fails with 712
(``cudaErrorHostMemoryAlreadyRegistered``) when one of them is already locked;
a failure sets the per-thread "last error" that ``cudaGetLastError`` returns and
clears, which is what a later torch CUDA call would otherwise report as its own.
"""

from __future__ import annotations

import threading

ALREADY_REGISTERED = 712
PAGE = 4096


class PageLockingRuntime:
    def __init__(self, *, fail_call: int | None = None, fail_error: int = 2, page: int = PAGE, origin: int = 0) -> None:
        """``page``: the page size to emulate (65536 for aarch64 kernels), counted from address ``origin``
        (the start of a mapping made on this machine's smaller pages)."""
        self.page, self.origin = page, origin
        self.locked: dict[int, tuple[int, int]] = {}  # ptr -> (first page, end page)
        self.calls: list[tuple[int, int]] = []
        self.fail_call, self.fail_error = fail_call, fail_error
        self._last = threading.local()

    @property
    def last_error(self) -> int:
        return getattr(self._last, "error", 0)

    def _fail(self, err: int) -> int:
        self._last.error = err
        return err

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append((ptr, size))
        if self.fail_call is not None and len(self.calls) == self.fail_call:
            return self._fail(self.fail_error)
        at = ptr - self.origin
        first, end = at // self.page, -(-(at + size) // self.page)
        if any(a < end and first < b for a, b in self.locked.values()):
            return self._fail(ALREADY_REGISTERED)
        self.locked[ptr] = (first, end)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0 if self.locked.pop(ptr, None) else self._fail(1)

    def cudaGetLastError(self) -> int:  # noqa: N802
        err, self._last.error = self.last_error, 0
        return err
