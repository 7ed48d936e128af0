"""Batched record I/O: runs of consecutive records, one vectored syscall per run, no event loop.

A batch arrives sorted by disk slot and is cut into runs of consecutive slots. A buffered run is ONE
``pwritev``/``preadv`` whose iovecs alternate a "gap" and a payload: the gap of record j is the zero padding
that ends record j-1 followed by record j's header (both live in one per-batch numpy array), the payload
is a slice of the CPU slab itself (zero copy). So a run costs two iovecs per record, and runs longer
than ``IOV_MAX / 2`` records are split. A slab may also be a ``[rows, ranks, shard]`` block view (the
shared segment's rank-major sub-slabs): a record's payload is then its ranks' pieces in rank order, one
iovec per rank (``1 + ranks`` per record), and the checksum is the same xxh3 of those bytes in that order,
so a record reads back whichever layout wrote it. O_DIRECT needs aligned memory, so there each run goes through
this thread's page-aligned bounce buffer, as many whole records at a time as it holds.

Nothing here interprets a failure: ``write_batch`` raises the OSError of the first run that fails (no
later run is issued, so nothing is in flight when it returns), ``read_batch`` reports which records
were read whole, and the caller verifies them.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from ..slab_parts import SlabParts, xxh_parts
from .files import pwritev_all
from .format import HEADER_SIZE

IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024)
BOUNCE_BYTES = 16 << 20  # per thread, O_DIRECT only; always at least one record
_xxh = xxhash.xxh3_64_intdigest


def find_runs(slots: np.ndarray, max_len: int) -> list[tuple[int, int]]:
    """``[a, b)`` index ranges of runs of consecutive values in sorted ``slots``, each <= max_len long."""
    n = len(slots)
    if n == 0:
        return []
    cuts = np.flatnonzero(np.diff(slots) != 1) + 1
    out = []
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
        out.extend((s, min(s + max_len, b)) for s in range(a, b, max_len))
    return out


def _hash(slab: np.ndarray, rows: list[int]) -> np.ndarray:
    if slab.ndim == 2 and slab.flags.c_contiguous:
        flat, bpb = memoryview(slab).cast("B"), slab.shape[1]
        return np.fromiter((_xxh(flat[r * bpb : (r + 1) * bpb]) for r in rows), dtype=np.uint64, count=len(rows))
    parts = SlabParts(slab)
    return np.fromiter((xxh_parts(parts.views(r)) for r in rows), dtype=np.uint64, count=len(rows))


class Hasher:
    """xxh3-64 of slab rows, a large batch split over this thread and ``helpers`` more.

    xxhash drops the GIL while it hashes, so the pieces run in parallel: the checksum is the one cost a
    raw pwritev/preadv does not pay, and on a box with spare cores it should not add to a batch's time.
    Small batches stay in the calling thread (a thread hand-off costs more than hashing them).
    """

    split_bytes = 4 << 20  # below this a batch is hashed by the calling thread alone

    def __init__(self, helpers: int) -> None:
        self._helpers = helpers
        self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="tkv-disk-hash") if helpers else None

    def rows(self, slab: np.ndarray, rows: list[int]) -> np.ndarray:
        """Checksums of ``slab[rows[i]]`` (a C-contiguous 2-D uint8 array)."""
        n = len(rows)
        if self._pool is None or n < 2 or n * (slab.nbytes // max(1, len(slab))) < self.split_bytes:
            return _hash(slab, rows)
        cuts = np.linspace(0, n, min(n, self._helpers + 1) + 1).astype(int).tolist()
        futs = [self._pool.submit(_hash, slab, rows[a:b]) for a, b in zip(cuts[1:-1], cuts[2:], strict=True)]
        first = _hash(slab, rows[: cuts[1]])
        return np.concatenate([first, *(f.result() for f in futs)])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class RecordIO:
    """Vectored I/O of whole records for one data file geometry (record_size, bytes_per_block)."""

    def __init__(self, record_size: int, bytes_per_block: int) -> None:
        self.rs, self.bpb = record_size, bytes_per_block
        self.gap = record_size - bytes_per_block  # padding of the previous record + this header
        self.pad = self.gap - HEADER_SIZE
        self.direct = False
        self.max_run = (IOV_MAX - 1) // 2
        self._tls = threading.local()

    def use_direct(self) -> None:
        self.direct = True
        self.max_run = max(1, BOUNCE_BYTES // self.rs)

    def runs(self, slots: np.ndarray, parts: int = 1) -> list[tuple[int, int]]:
        """Runs of consecutive slots, each one syscall: ``1 + parts`` iovecs per record when buffered."""
        return find_runs(slots, self.max_run if self.direct else max(1, (IOV_MAX - 1) // (1 + parts)))

    # ---- writes --------------------------------------------------------------------------------------
    def write_batch(self, fd: int, slots: np.ndarray, headers: np.ndarray, src: np.ndarray, rows: list[int]) -> int:
        """Write records ``slots[i]`` = headers[i] + src[rows[i]]; returns the number of syscalls."""
        parts = SlabParts(src)
        runs = self.runs(slots, len(parts))
        if self.direct:
            return sum(self._write_direct(fd, int(slots[a]), headers[a:b], parts, rows[a:b]) for a, b in runs)
        gaps = np.zeros((len(rows), self.gap), np.uint8)
        gaps[:, self.pad :] = headers
        g, gw, bpb, pad = memoryview(gaps).cast("B"), self.gap, self.bpb, self.pad
        for a, b in runs:
            iov = [g[a * gw + pad : (a + 1) * gw], *parts.views(rows[a])]
            for j in range(a + 1, b):
                iov += (g[j * gw : (j + 1) * gw], *parts.views(rows[j]))
            pwritev_all(fd, iov, int(slots[a]) * self.rs, (b - a - 1) * self.rs + HEADER_SIZE + bpb)
        return len(runs)

    def _write_direct(self, fd: int, first: int, headers: np.ndarray, parts: SlabParts, rows: list[int]) -> int:
        buf, arr = self._bounce()
        k = len(rows)
        arr[:k, :HEADER_SIZE] = headers
        for i, r in enumerate(rows):
            at = HEADER_SIZE
            for p, w in zip(parts.parts, parts.widths, strict=True):
                arr[i, at : at + w] = p[r]
                at += w
        arr[:k, HEADER_SIZE + self.bpb :] = 0
        pwritev_all(fd, [buf[: k * self.rs]], first * self.rs, k * self.rs)
        return 1

    # ---- reads ---------------------------------------------------------------------------------------
    def read_batch(self, fd: int, slots: np.ndarray, dst: np.ndarray, rows: list[int]
                   ) -> tuple[np.ndarray, np.ndarray, int]:
        """Read records ``slots[i]`` into dst[rows[i]]: (headers uint8 [n, 128], read-whole mask, syscalls).

        Payloads land in place; a record cut short by the end of the file is not whole.
        """
        n = len(rows)
        whole = np.zeros(n, bool)
        parts = SlabParts(dst)
        runs = self.runs(slots, len(parts))
        if self.direct:
            headers = np.empty((n, HEADER_SIZE), np.uint8)
            for a, b in runs:
                self._read_direct(fd, int(slots[a]), headers[a:b], whole[a:b], parts, rows[a:b])
            return headers, whole, len(runs)
        gaps = np.empty((n, self.gap), np.uint8)
        g, gw, bpb, pad = memoryview(gaps).cast("B"), self.gap, self.bpb, self.pad
        for a, b in runs:
            iov = [g[a * gw + pad : (a + 1) * gw], *parts.views(rows[a])]
            for j in range(a + 1, b):
                iov += (g[j * gw : (j + 1) * gw], *parts.views(rows[j]))
            got = os.preadv(fd, iov, int(slots[a]) * self.rs)
            whole[a:b] = np.arange(b - a) * self.rs + HEADER_SIZE + bpb <= got
        return np.ascontiguousarray(gaps[:, pad:]), whole, len(runs)

    def _read_direct(self, fd: int, first: int, headers: np.ndarray, whole: np.ndarray, parts: SlabParts,
                     rows: list[int]) -> None:  # fmt: skip
        buf, arr = self._bounce()
        k = len(rows)
        got = os.preadv(fd, [buf[: k * self.rs]], first * self.rs)
        headers[:] = arr[:k, :HEADER_SIZE]
        for i, r in enumerate(rows):
            at = HEADER_SIZE
            for p, w in zip(parts.parts, parts.widths, strict=True):
                p[r] = arr[i, at : at + w]
                at += w
        whole[:] = np.arange(k) * self.rs + HEADER_SIZE + self.bpb <= got

    def _bounce(self) -> tuple[memoryview, np.ndarray]:
        """This thread's page-aligned buffer of ``max_run`` records (mmap memory is page aligned)."""
        b = getattr(self._tls, "bounce", None)
        if b is None:
            m = mmap.mmap(-1, self.max_run * self.rs)
            b = self._tls.bounce = (memoryview(m), np.frombuffer(m, np.uint8).reshape(self.max_run, self.rs))
        return b
