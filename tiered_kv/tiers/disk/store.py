"""DiskStore: block records at integer slots of one preallocated file; crash-consistent, verified, persistent.

The cache owns the key -> slot index and eviction; this class only stores bytes and verifies them. Format:
see format.py. The API is per batch: ``write_many`` / ``read_many`` move rows of the CPU slab (a
``uint8[num_cpu_slots, bytes_per_block]`` array) to and from disk slots, one executor job per call.
Write protocol, per batch:

 1. ONE journal append of invalidate records: the batch's slots that hold commits, plus whatever
    ``invalidate_many`` queued, so a crash from here on never offers a slot's old key;
 2. ONE ``pwritev`` per run of consecutive disk slots (records.py: zero copy from the slab rows; with
    O_DIRECT through a page-aligned bounce buffer);
 3. ONE journal append of commit records (seq, slot, key, xxh3 of the payload).

All three (and their fdatasyncs when fsync=True) are ONE job on the tier's executor (batch_job.py): the
loop hands a batch off once, and keeps the journal's bookkeeping before and after it (journal.py).

Trust: the cache directory and namespace directory must be ours and not group/world-writable; the
namespace dir is held open and every file is opened relative to it, never through a link (files.py).
Recovery streams the journal in bounded chunks (recovery.py).

A kill -9 between any two steps leaves the batch uncommitted in the journal, and a torn record fails its
header/key/payload checks on read, so a reader gets the old block, nothing, or the new block. Every read
re-verifies header, key, slot, length and payload checksum, record by record: a block that fails is
False in the returned mask, never an exception. A fault of the batch itself (ENOSPC, EIO, a journal that
cannot take more records) raises DiskError, and only once the batch has ended: nothing of it is in
flight by then, and a cancelled call also waits for its batch before re-raising, because cancelling an
await does not stop a pwritev/preadv on the slab. Large batches split their checksums over helper
threads (records.Hasher).

I/O: every file call goes through aiofiles on the tier's own executor (aio.py): the files are opened and
closed with ``aiofiles.open``, the journal read (and appended by flush/aclose) through them,
stat/unlink/rename through ``aiofiles.os``, and each batch's job (its journal appends through the
journal's fd, its data) through ``aiofiles.os.wrap``: one hand-off per batch, one syscall per run inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from aiofiles.threadpool.binary import AsyncFileIO

from tiered_kv.errors import ConfigError, DiskError, LayoutError

from .admin import open_namespace_dir
from .aio import DiskCalls
from .batch_args import check_batch, check_keys, slot_array
from .files import probe_aligned_read
from .format import DATA_FILE, DiskNamespace, check_header, check_headers, encode_headers
from .journal import Journal, journal_limit
from .records import Hasher, RecordIO
from .recovery import READ_CHUNK

__all__ = ["DiskNamespace", "DiskStore", "RecoveredBlock"]

log = logging.getLogger("tiered_kv.disk")

_SEQ_LIMIT = 1 << 63  # recovery refuses seqs at or above this
_WHYS_LOGGED = 8  # failed records named in one verification WARNING


def _log_drop(cause: str, n: int, detail: str) -> None:
    log.warning("disk tier dropped %d block(s) at recovery: %s (%s)", n, cause, detail)


class RecoveredBlock(NamedTuple):
    """A block committed by an earlier run (a NamedTuple: recovery builds ~1e5 of them per second)."""

    key: bytes
    slot: int
    seq: int


class DiskStore:
    """Slot-addressed block store for the disk tier (see the module docstring for the protocol)."""

    compact_slack = 65536  # stale journal records tolerated beyond 2x the live set before compacting
    journal_floor = 64 << 20  # the journal's bound in bytes is max(this, 4 records per slot)
    journal_read_chunk = READ_CHUNK  # bytes per read when replaying the journal at open

    def __init__(self, root: str | os.PathLike, namespace: DiskNamespace, num_slots: int,
                 part_sizes: Sequence[int] | None = None, *, o_direct: bool = False, allow_symlink: bool = False,
                 io_threads: int = 4, fsync: bool = False, hash_threads: int | None = None,
                 on_drop: Callable[[str, int, str], None] | None = None) -> None:  # fmt: skip
        # part_sizes: accepted for callers that still pass the layout's regions; a block is one slab row.
        if part_sizes is not None and (sum(part_sizes) != namespace.bytes_per_block or min(part_sizes) <= 0):
            raise LayoutError(f"part_sizes {list(part_sizes)} (sum {sum(part_sizes)}) must be positive and sum "
                              f"to bytes_per_block {namespace.bytes_per_block}")  # fmt: skip
        if not isinstance(num_slots, int) or not 0 < num_slots < 2**32:
            raise ConfigError(f"disk num_slots must be in [1, 2**32), got {num_slots!r}")
        if io_threads < 1:
            raise ConfigError(f"disk io_threads must be >= 1, got {io_threads}")
        # Checksum helpers beside each I/O thread: by default one per spare core, at most 3.
        self._hash_threads = min(3, (os.cpu_count() or 1) - 1) if hash_threads is None else hash_threads
        if self._hash_threads < 0:
            raise ConfigError(f"disk hash_threads must be >= 0, got {hash_threads}")
        self.root = os.fspath(root)
        self.namespace = namespace
        self.path = os.path.join(self.root, namespace.dirname())
        self.num_slots = num_slots
        self.record_size = namespace.record_size
        self._bpb, self._kb = namespace.bytes_per_block, namespace.key_bytes
        self._want_direct, self._allow_symlink, self._fsync = o_direct, allow_symlink, fsync
        self._io_threads = io_threads
        self.o_direct_active = False
        self.o_direct_reason = "not requested"
        # Counters (loop thread only): blocks, bytes, and the syscalls and journal appends behind them.
        self.corrupt_blocks = self.bytes_written = self.bytes_read = self.writes = self.reads = 0
        self.write_errors = self.write_syscalls = self.read_syscalls = 0
        self.recovered: list[RecoveredBlock] = []
        self._on_drop = on_drop or _log_drop
        self._calls: DiskCalls | None = None
        self._data: AsyncFileIO | None = None  # the data file; _dfd is its fd, for the batch jobs
        self._hasher: Hasher | None = None
        self._journal = Journal(self.path, self._kb, num_slots, fsync=fsync, compact_slack=0, limit=0)
        self._io = RecordIO(self.record_size, self._bpb)
        self._closed = False
        self._dfd = self._lockfd = self._nsfd = -1
        self._seq = 0
        self._writing = np.zeros(num_slots, bool)  # slots with a write in flight
        # Buffered pwrites to one file serialize on its inode lock: a second writer measured slower, not
        # faster. Held across a batch's whole job; O_DIRECT batches of other slots overlap.
        self._write_lock = asyncio.Lock()

    @property
    def journal_appends(self) -> int:
        """Journal record writes so far (a batch makes at most two)."""
        return self._journal.appends

    # ---- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> list[RecoveredBlock]:
        """Create or reopen the namespace dir; return committed blocks, oldest -> newest by seq."""
        if self._calls is not None or self._closed:
            raise DiskError(errno.EINVAL, "DiskStore.open() may be called once", self.path)
        self._calls = DiskCalls(self._io_threads)
        self._hasher = Hasher(self._hash_threads)
        try:
            self.recovered = await self._calls.shielded(self._open_files())
        except BaseException as e:
            await self.aclose()
            if isinstance(e, OSError) and not isinstance(e, DiskError):
                raise DiskError(e.errno, f"cannot open disk tier: {e.strerror}", e.filename or self.path) from e
            raise
        for cause, (n, detail) in self._journal.issues.items():
            self._on_drop(cause, n, f"{detail}; in {self.path}")
        return self.recovered

    async def __aenter__(self) -> DiskStore:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Flush queued invalidations, wait for in-flight jobs, close files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        calls = self._calls
        if calls is None:
            return
        try:
            await calls.drain()  # batches in flight end before their files close
            if self._journal.fd >= 0:
                await calls.shielded(self._journal.before_write(np.zeros(0, np.int64), self._seq))
        except OSError as e:
            log.warning("disk tier: final journal flush failed in %s: %s", self.path, e)
        finally:
            await calls.shielded(self._close_files())
            await calls.shutdown()
            if self._hasher is not None:
                await asyncio.to_thread(self._hasher.close)

    async def _close_files(self) -> None:
        await self._journal.close()
        data, self._data, self._dfd = self._data, None, -1
        if data is not None:
            await data.close()
        fds, self._nsfd, self._lockfd = (self._nsfd, self._lockfd), -1, -1
        for fd in fds:  # the lock fd last: closing it releases the flock
            if fd >= 0:
                await self._calls.run(os.close, fd)

    # ---- public I/O ------------------------------------------------------------------------------
    async def write_many(self, disk_slots: np.ndarray, keys: np.ndarray, src: np.ndarray,
                         cpu_slots: np.ndarray) -> np.ndarray:  # fmt: skip
        """Store row ``cpu_slots[i]`` of ``src`` as the block ``keys[i]`` at ``disk_slots[i]``.

        ``src`` is the CPU slab (C-contiguous ``uint8[rows, bytes_per_block]``), ``keys`` is
        ``uint8[n, key_bytes]``, the disk slots are distinct. Returns the per-block ok mask: a slot that
        already has a write in flight is False (left alone). Raises KeyFormatError / LayoutError for
        arguments that do not fit (nothing written), DiskError (errno ENOSPC, EIO, ...) for a fault of the
        batch: then no block of it is committed, and slots it was overwriting may have lost their old blocks.
        """
        d, c = self._check_batch(disk_slots, cpu_slots, src, writable=False)
        keys = check_keys(keys, len(d), self._kb)
        if len(np.unique(d)) != len(d):
            raise LayoutError(f"disk slots of one write batch must be distinct; got {len(d) - len(np.unique(d))} "
                              f"repeated among {len(d)}")  # fmt: skip
        ok = ~self._writing[d]
        go = np.flatnonzero(ok)
        if not len(go):
            return ok
        if self._seq + len(go) >= _SEQ_LIMIT:
            raise DiskError(errno.EOVERFLOW, f"journal sequence numbers exhausted at {self._seq}", self.path)
        by_slot = np.argsort(d[go], kind="stable")
        seqs = np.arange(self._seq + 1, self._seq + 1 + len(go), dtype=np.uint64)[by_slot]  # seq order = call order
        self._seq += len(go)
        order = go[by_slot]
        slots = d[order]
        self._writing[slots] = True
        try:
            syscalls = await self._calls.shielded(self._write(slots, keys[order], seqs, src, c[order].tolist()))
        except Exception as e:
            self.write_errors += 1
            # DEBUG: the caller gets the error; DiskIO turns it into one WARNING and a degraded tier.
            log.debug("disk tier: write of %d blocks failed in %s: %r", len(slots), self.path, e)
            if isinstance(e, OSError) and not isinstance(e, DiskError):
                raise DiskError(e.errno, f"disk tier write of {len(slots)} blocks failed: {e.strerror}",
                                self.path) from e  # fmt: skip
            raise
        finally:
            self._writing[slots] = False
        self.writes += len(slots)
        self.bytes_written += len(slots) * self._bpb
        self.write_syscalls += syscalls
        return ok

    async def read_many(self, disk_slots: np.ndarray, keys: np.ndarray, dst: np.ndarray,
                        cpu_slots: np.ndarray) -> np.ndarray:  # fmt: skip
        """Read the block ``keys[i]`` at ``disk_slots[i]`` into row ``cpu_slots[i]`` of ``dst``.

        Returns the per-block ok mask: False where the record does not verify (its row is then
        undefined). The CPU rows are distinct. Raises KeyFormatError / LayoutError for arguments that do
        not fit, DiskError for a fault of the batch (EIO), once nothing of it is in flight.
        """
        d, c = self._check_batch(disk_slots, cpu_slots, dst, writable=True)
        keys = check_keys(keys, len(d), self._kb)
        if len(np.unique(c)) != len(c):
            raise LayoutError(f"cpu slots of one read batch must be distinct; got {len(c) - len(np.unique(c))} "
                              f"repeated among {len(c)}")  # fmt: skip
        n = len(d)
        if not n:
            return np.zeros(0, bool)
        order = np.argsort(d, kind="stable")
        try:
            ok_sorted, whys, syscalls = await self._calls.shielded(self._calls.run(
                self._read_sync, d[order], keys[order], dst, c[order].tolist()))  # fmt: skip
        except OSError as e:
            if isinstance(e, DiskError):
                raise
            raise DiskError(e.errno, f"disk tier read of {n} blocks failed: {e.strerror}", self.path) from e
        ok = np.empty(n, bool)
        ok[order] = ok_sorted
        bad = n - int(np.count_nonzero(ok))
        self.reads += n
        self.read_syscalls += syscalls
        self.bytes_read += (n - bad) * self._bpb
        if bad:
            self.corrupt_blocks += bad
            log.warning("disk tier: %d of %d block(s) in %s failed verification, served as misses: %s", bad, n,
                        self.path, "; ".join(whys))  # fmt: skip
        return ok

    def invalidate_many(self, slots: np.ndarray) -> None:
        """Forget ``slots`` for recovery. Synchronous and non-blocking (safe in the cache's bookkeeping).

        The invalidate records are queued; they reach the journal before the next batch's writes, at
        ``flush()`` or at ``aclose()``. A crash before that may recover a slot's old block, which is still
        intact and verified on read (its bytes are only overwritten after the record is journaled).
        """
        self._check_open()
        s = slot_array(slots, "slots", self.num_slots)
        if len(s):
            self._journal.queue_invalidate(s)

    async def flush(self) -> None:
        """Journal queued invalidations now (and fdatasync the journal when fsync=True)."""
        self._check_open()
        await self._calls.shielded(self._journal.before_write(np.zeros(0, np.int64), self._seq))

    # ---- argument checks on the loop (vectorized) ------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self._calls is None or self._dfd < 0:
            raise DiskError(errno.EBADF, "disk store is not open", self.path)

    def _check_batch(
        self, disk_slots: Any, cpu_slots: Any, slab: Any, *, writable: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        self._check_open()
        return check_batch(disk_slots, cpu_slots, slab, self.num_slots, self._bpb, writable=writable)

    # ---- the protocols (each runs as one shielded task) -----------------------------------------------
    async def _open_files(self) -> list[RecoveredBlock]:
        # Each file goes into self as soon as it is open: a failure later on is cleaned up by aclose().
        calls = self._calls
        self._nsfd, self._lockfd = await calls.run(open_namespace_dir, self.root, self.namespace,
                                                   allow_symlink=self._allow_symlink)  # fmt: skip
        self._data = await calls.open(DATA_FILE, dir_fd=self._nsfd, path=os.path.join(self.path, DATA_FILE))
        self._dfd = self._data.fileno()
        self._journal.compact_slack = self.compact_slack
        self._journal.limit = journal_limit(self.num_slots, self.journal_floor)
        self._journal.read_chunk = self.journal_read_chunk
        keys, slots, seqs = await self._journal.load(calls, self._nsfd)  # drops (and compacts away) slots >= num_slots
        self._seq = self._journal.max_seq
        if (await calls.stat(self._dfd)).st_size != self.num_slots * self.record_size:
            await self._data.truncate(self.num_slots * self.record_size)  # sparse; a smaller num_slots cuts the tail
        await self._setup_direct()
        log.info("disk tier %s: %d blocks recovered, %d slots of %d bytes, O_DIRECT %s", self.path,
                 len(slots), self.num_slots, self.record_size, self.o_direct_active)  # fmt: skip
        return list(map(RecoveredBlock._make, zip(keys, slots, seqs, strict=True)))

    async def _setup_direct(self) -> None:
        if not self._want_direct:
            return
        path = os.path.join(self.path, DATA_FILE)
        if not hasattr(os, "O_DIRECT"):
            self.o_direct_reason = "O_DIRECT is not available on this platform"
        else:
            try:
                f = await self._calls.open(DATA_FILE, dir_fd=self._nsfd, path=path,
                                            opener=lambda _name: self._open_direct(path))
            except OSError as e:
                self.o_direct_reason = f"O_DIRECT open failed on {path}: {e}"
            else:
                self.o_direct_reason = await self._calls.run(probe_aligned_read, f.fileno(), path)
                if not self.o_direct_reason:
                    old, self._data, self._dfd, self.o_direct_active = self._data, f, f.fileno(), True
                    self._io.use_direct()
                    await old.close()
                    return
                await f.close()
        log.warning("disk tier: O_DIRECT requested but unusable, falling back to buffered I/O: %s",
                    self.o_direct_reason)  # fmt: skip

    def _open_direct(self, path: str) -> int:
        fd = os.open(DATA_FILE, os.O_RDWR | os.O_DIRECT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=self._nsfd)  # fmt: skip
        a, b = os.fstat(fd), os.fstat(self._dfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # swapped since we checked it
            os.close(fd)
            raise OSError(errno.ESTALE, "data file changed while opening it", path)
        return fd

    async def _write(self, slots: np.ndarray, keys: np.ndarray, seqs: np.ndarray, src: np.ndarray,
                     rows: list[int]) -> int:  # fmt: skip
        """Invalidations, data, commits for one batch sorted by slot, in one executor job; returns the data
        syscalls made. Buffered: one batch at a time (``_write_lock``); O_DIRECT: beside other batches."""
        dfd, fsync = self._dfd, self._fsync

        def write_data() -> tuple[np.ndarray, int]:  # step 2 of the job, on its thread
            psums, syscalls = self._write_records(slots, keys, seqs, src, rows)
            if fsync:
                os.fdatasync(dfd)
            return psums, syscalls

        async with self._write_lock if not self.o_direct_active else contextlib.nullcontext():
            return await self._journal.write_batch(slots, seqs, keys, write_data)

    def _write_records(self, slots: np.ndarray, keys: np.ndarray, seqs: np.ndarray, src: np.ndarray,
                       rows: list[int]) -> tuple[np.ndarray, int]:  # fmt: skip
        """The batch's checksums and data (in its executor job): one pwritev per run of consecutive slots."""
        psums = self._hasher.rows(src, rows)
        headers = encode_headers(slots, keys, self._bpb, seqs, psums)
        return psums, self._io.write_batch(self._dfd, slots, headers, src, rows)

    def _read_sync(self, slots: np.ndarray, keys: np.ndarray, dst: np.ndarray, rows: list[int]
                   ) -> tuple[np.ndarray, list[str], int]:  # fmt: skip
        """Read one batch sorted by slot and verify each record: (ok mask, why for a few failures, syscalls)."""
        headers, whole, syscalls = self._io.read_batch(self._dfd, slots, dst, rows)
        ok, psums = check_headers(headers, slots, keys, self._bpb)
        ok &= whole
        idx = np.flatnonzero(ok)
        ok[idx] = self._hasher.rows(dst, [rows[i] for i in idx.tolist()]) == psums[idx]
        whys = []
        for i in np.flatnonzero(~ok)[:_WHYS_LOGGED].tolist():
            slot = int(slots[i])
            why = check_header(headers[i].tobytes(), slot, keys[i].tobytes(), self._bpb)[1] or "payload checksum mismatch"
            whys.append(f"slot {slot}: {'short read' if not whole[i] else why}")
        return ok, whys, syscalls
