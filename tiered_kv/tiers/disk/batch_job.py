"""One write batch's journal records and data bytes in ONE executor job (a tier thread, no event loop).

The loop (``Journal.write_batch``) decides everything before the job -- which slots need invalidation
records, the offset they go to, compaction at the bound -- and settles the journal mirror after it, from
what the job says it got done (``inv_done`` / ``commit_done``), whether the job raised or not. The job
only encodes and writes, in protocol order:

 1. the invalidation records at the journal's offset ``at`` (fdatasync'ed when fsync), before any data
    bytes change, so a crash from there on never offers a slot's old key;
 2. the data: ``write_data()`` (checksums + one pwritev per run of slots, its fdatasync when fsync);
 3. the commit records right after the invalidations (fdatasync'ed when fsync), only once the data landed.

Appends go through the journal's own fd at our own offset, not O_APPEND: a failed append is cut off and
the file position put back at its start, so the next append lands on a record boundary.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import numpy as np

from .format import JCOMMIT, JINVALIDATE, encode_records


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    """os.pwrite until all of ``data`` is at ``at`` (a short write goes on from where it stopped, so the
    real errno surfaces). pwrite, not pwritev: the data's vectored writes stay countable apart."""
    mv, done = memoryview(data), 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], at + done)
        if not n:
            raise OSError(0, f"write made no progress at byte {done} of {len(mv)}")
        done += n


def append_at(fd: int, data: bytes, at: int, fsync: bool) -> None:
    """Write ``data`` at offset ``at`` of the journal (then fdatasync when ``fsync``); on failure cut the
    file back to ``at``. Either way the position ends at the end of what the journal holds."""
    try:
        _pwrite_all(fd, data, at)
        if fsync:
            os.fdatasync(fd)
    except OSError:
        with contextlib.suppress(OSError):  # cut what got written ...
            os.ftruncate(fd, at)
        with contextlib.suppress(OSError):  # ... and in any case append at the record boundary next time
            os.lseek(fd, at, os.SEEK_SET)
        raise
    os.lseek(fd, at + len(data), os.SEEK_SET)  # flush()'s appends go through the file's position


class Tail:
    """The journal's end as the batch jobs in flight see it: their appends take turns under ``lock``, each
    at ``end`` (a failed one is cut off there, so ``end`` stays on a record boundary)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.end = 0

    def append(self, fd: int, data: bytes, fsync: bool) -> None:
        with self.lock:
            append_at(fd, data, self.end, fsync)
            self.end += len(data)


class BatchJob:
    """The I/O of one batch, sorted by slot; call it on an executor thread. Returns the data syscalls."""

    def __init__(self, fd: int, tail: Tail, fsync: bool, inv: np.ndarray, inv_seq: int, slots: np.ndarray,
                 seqs: np.ndarray, keys: np.ndarray,
                 write_data: Callable[[], tuple[np.ndarray, int]]) -> None:  # fmt: skip
        self.fd, self.tail, self.fsync = fd, tail, fsync
        self.inv, self.inv_seq, self.slots, self.seqs, self.keys = inv, inv_seq, slots, seqs, keys
        self.write_data = write_data
        self.appends = self.inv_bytes = self.commit_bytes = 0  # read by the loop once the job ended
        self.inv_done = self.commit_done = False
        self.psums = np.zeros(0, np.uint64)

    def __call__(self) -> int:
        if len(self.inv):
            recs = encode_records(JINVALIDATE, self.inv, self.inv_seq)
            self.appends += 1
            self.tail.append(self.fd, recs, self.fsync)
            self.inv_bytes, self.inv_done = len(recs), True
        self.psums, syscalls = self.write_data()
        recs = encode_records(JCOMMIT, self.slots, self.seqs, self.psums, self.keys)
        self.appends += 1
        self.tail.append(self.fd, recs, self.fsync)
        self.commit_bytes, self.commit_done = len(recs), True
        return syscalls
