"""DiskStore: block bytes at integer slots of one preallocated file; crash-consistent, verified, persistent.

The cache owns the key -> slot index and eviction; this class only stores bytes and verifies them. Format:
see disk_format.py. Write protocol, per block:

 1. if the journal holds a commit for the slot, append an invalidate record (together with any queued
    ``invalidate()`` calls), so a crash from here on never offers the slot's old key;
 2. ONE ``pwritev([header, *parts])`` at ``slot * record_size`` (zero copy from the caller's rows; with
    O_DIRECT the parts are copied into a page-aligned bounce buffer instead);
 3. append the commit record (seq, slot, key, xxh3 of the payload).

A kill -9 between any two steps leaves the slot uncommitted in the journal, and a torn record fails its
header/key/payload checks on read, so a reader gets the old block, nothing, or the new block. Every read
re-verifies header, key, slot, length and payload checksum; bad data is a miss (False), never an exception.

Concurrency: reads and writes issued together are coalesced into batches (``io_batcher.IOBatcher``), one executor job
per batch, up to ``io_threads`` batches at once (1 for buffered writes); a batch journals its invalidations
in one record write and its commits in another. One executor round trip per block would cost as much as a
256 KiB pwrite itself. The journal (disk_journal.Journal) is touched only by executor threads holding its
lock; the event loop only queues invalidations and counts stats, so it never waits on that lock. A cancelled ``read``/``write``
still waits for its executor work before re-raising: cancelling an await does not stop a pwritev/preadv
into the caller's buffers.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import aiofiles.os

from tiered_kv.errors import ConfigError, DiskError, LayoutError
from tiered_kv.tiers.disk_admin import prepare_namespace_dir
from tiered_kv.tiers.disk_format import (
    DATA_FILE,
    DiskNamespace,
    encode_header,
    open_private,
    payload_xxh,
    probe_o_direct,
    read_record,
    write_record,
)
from tiered_kv.tiers.disk_journal import Journal
from tiered_kv.tiers.io_batcher import IOBatcher, wait_to_end

__all__ = ["DiskNamespace", "DiskStore", "RecoveredBlock"]

log = logging.getLogger("tiered_kv.disk")


class RecoveredBlock(NamedTuple):
    """A block committed by an earlier run (a NamedTuple: recovery builds ~1e5 of them per second)."""

    key: bytes
    slot: int
    seq: int


class DiskStore:
    """Slot-addressed block store for the disk tier (see the module docstring for the protocol)."""

    compact_slack = 65536  # stale journal records tolerated beyond 2x the live set before compacting

    def __init__(self, root: str | os.PathLike, namespace: DiskNamespace, num_slots: int,
                 part_sizes: Sequence[int], *, o_direct: bool = False, allow_symlink: bool = False,
                 io_threads: int = 4, fsync: bool = False) -> None:
        sizes = [int(s) for s in part_sizes]
        if not sizes or min(sizes) <= 0 or sum(sizes) != namespace.bytes_per_block:
            raise LayoutError(f"part_sizes {sizes} (sum {sum(sizes)}) must be positive and sum to "
                              f"bytes_per_block {namespace.bytes_per_block}")
        if not isinstance(num_slots, int) or not 0 < num_slots < 2**32:
            raise ConfigError(f"disk num_slots must be in [1, 2**32), got {num_slots!r}")
        if io_threads < 1:
            raise ConfigError(f"disk io_threads must be >= 1, got {io_threads}")
        self.root = os.fspath(root)
        self.namespace = namespace
        self.path = os.path.join(self.root, namespace.dirname())
        self.num_slots, self.part_sizes = num_slots, tuple(sizes)
        self.record_size = namespace.record_size
        self._bpb = namespace.bytes_per_block
        self._want_direct, self._allow_symlink, self._fsync = o_direct, allow_symlink, fsync
        self._io_threads = io_threads
        self.o_direct_active = False
        self.o_direct_reason = "not requested"
        self.corrupt_blocks = self.bytes_written = self.bytes_read = self.writes = self.reads = 0
        self.write_errors = 0
        self.recovered: list[RecoveredBlock] = []
        self._executor: ThreadPoolExecutor | None = None
        self._journal = Journal(self.path, namespace.key_bytes, num_slots, fsync=fsync, compact_slack=0)
        self._closed = False
        self._dfd = self._lockfd = -1
        self._seq = 0
        self._writing: set[int] = set()
        self._tls = threading.local()  # per-thread O_DIRECT bounce buffers
        self._aio_open, self._aio_flush = aiofiles.os.wrap(self._open_sync), aiofiles.os.wrap(self._flush_sync)
        self._writes = IOBatcher(self._write_batch_sync, io_threads)
        self._reads = IOBatcher(self._read_batch_sync, io_threads)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def open(self) -> list[RecoveredBlock]:
        """Create or reopen the namespace dir; return committed blocks, oldest -> newest by seq."""
        if self._executor is not None or self._closed:
            raise DiskError(errno.EINVAL, "DiskStore.open() may be called once", self.path)
        self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="tkv-disk")
        try:
            self.recovered = await self._run(self._aio_open)
        except BaseException as e:
            await self.aclose()
            if isinstance(e, OSError) and not isinstance(e, DiskError):
                raise DiskError(e.errno, f"cannot open disk tier: {e.strerror}", e.filename or self.path) from e
            raise
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
        if self._executor is None:
            return
        try:
            if self._journal.fd >= 0:
                await self._run(self._aio_flush)
        except OSError as e:
            log.warning("disk tier: final journal flush failed in %s: %s", self.path, e)
        finally:
            # shutdown(wait=True) joins the pool's threads, so it cannot run inside the pool itself.
            await asyncio.to_thread(self._shutdown_sync)

    def _shutdown_sync(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._journal.close()
        fds, self._dfd, self._lockfd = (self._dfd, self._lockfd), -1, -1
        for fd in fds:  # the lock fd last: closing it releases the flock
            if fd >= 0:
                os.close(fd)

    # ---- public I/O ------------------------------------------------------------------------------
    async def write(self, slot: int, key: bytes, parts: Sequence[Any]) -> None:
        """Store ``parts`` (one buffer per layout region) as the block ``key`` at ``slot``.

        Raises DiskError (with errno: ENOSPC, EIO, ...) on failure; the slot is then uncommitted, other
        slots are untouched. Writes to different slots may run concurrently; to the same slot, not.
        """
        self._check(slot, key)
        views = self._views(parts, writable=False)
        if slot in self._writing:
            raise DiskError(errno.EBUSY, f"slot {slot} already has a write in flight", self.path)
        self._seq += 1
        self._writing.add(slot)
        try:
            err = await self._writes.call(self._executor, slot, key, self._seq, views)
            if err is not None:
                raise err
        except OSError as e:
            self.write_errors += 1
            log.warning("disk tier: write of slot %d failed in %s: %s", slot, self.path, e)
            if isinstance(e, DiskError):
                raise
            raise DiskError(e.errno, f"disk tier write of slot {slot} failed: {e.strerror}", self.path) from e
        finally:
            self._writing.discard(slot)
        self.writes += 1
        self.bytes_written += self._bpb

    async def read(self, slot: int, key: bytes, parts: Sequence[Any]) -> bool:
        """Read the block ``key`` at ``slot`` into ``parts``; False (parts undefined) if it does not verify."""
        self._check(slot, key)
        views = self._views(parts, writable=True)
        try:
            why = await self._reads.call(self._executor, slot, key, views)
            if isinstance(why, OSError):
                raise why
        except OSError as e:
            raise DiskError(e.errno, f"disk tier read of slot {slot} failed: {e.strerror}", self.path) from e
        self.reads += 1
        if why:
            self.corrupt_blocks += 1
            log.warning("disk tier: slot %d in %s failed verification (%s); served as a miss", slot, self.path, why)
            return False
        self.bytes_read += self._bpb
        return True

    def invalidate(self, slot: int) -> None:
        """Forget ``slot`` for recovery. Synchronous and non-blocking (safe in the cache's bookkeeping).

        The invalidate record is queued; it reaches the journal before the next write of any slot, at
        ``flush()`` or at ``aclose()``. A crash before that may recover the slot's old block, which is still
        intact and verified on read (its bytes are only overwritten after the record is journaled).
        """
        self._check(slot, None)
        self._journal.queue_invalidate(slot)

    async def flush(self) -> None:
        """Journal queued invalidations now (and fdatasync the journal when fsync=True)."""
        self._check(0, None)
        await self._run(self._aio_flush)

    def stats(self) -> dict[str, int]:
        return {"corrupt_blocks": self.corrupt_blocks, "bytes_written": self.bytes_written,
                "bytes_read": self.bytes_read, "writes": self.writes, "reads": self.reads,
                "write_errors": self.write_errors}

    # ---- helpers on the loop -----------------------------------------------------------------------
    def _check(self, slot: int, key: bytes | None) -> None:
        if self._closed or self._executor is None or self._dfd < 0:
            raise DiskError(errno.EBADF, "disk store is not open", self.path)
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"disk slot {slot} out of range [0, {self.num_slots})")
        if key is not None and len(key) != self.namespace.key_bytes:
            raise ValueError(f"key has {len(key)} bytes, namespace says {self.namespace.key_bytes}")

    def _views(self, parts: Sequence[Any], *, writable: bool) -> list[memoryview]:
        if len(parts) != len(self.part_sizes):
            raise LayoutError(f"got {len(parts)} parts, layout has {len(self.part_sizes)} {list(self.part_sizes)}")
        out = []
        for i, (p, size) in enumerate(zip(parts, self.part_sizes, strict=True)):
            try:
                mv = memoryview(p).cast("B")
            except TypeError as e:
                raise LayoutError(f"part {i} is not a contiguous buffer: {e}") from e
            if mv.nbytes != size:
                raise LayoutError(f"part {i} has {mv.nbytes} bytes, layout says {size}")
            if writable and mv.readonly:
                raise LayoutError(f"part {i} is read-only; read() needs writable buffers")
            out.append(mv)
        return out

    async def _run(self, afn: Any) -> Any:
        return await wait_to_end(asyncio.ensure_future(afn(executor=self._executor)))

    # ---- executor jobs -----------------------------------------------------------------------------
    def _open_sync(self) -> list[RecoveredBlock]:
        self._lockfd = prepare_namespace_dir(self.root, self.namespace, allow_symlink=self._allow_symlink)
        self._dfd = open_private(os.path.join(self.path, DATA_FILE))
        self._journal.compact_slack = self.compact_slack
        keys, slots, seqs = self._journal.load()  # drops (and compacts away) slots >= num_slots
        self._seq = self._journal.max_seq
        if os.fstat(self._dfd).st_size != self.num_slots * self.record_size:
            os.ftruncate(self._dfd, self.num_slots * self.record_size)  # sparse; a smaller num_slots cuts the tail
        self._setup_direct()
        if not self.o_direct_active:  # buffered pwrites to one file serialize on its inode lock and xxh3
            self._writes.max_jobs = 1  # holds the GIL: a second writer thread measured slower, not faster
        log.info("disk tier %s: %d blocks recovered, %d slots of %d bytes, O_DIRECT %s", self.path,
                 len(slots), self.num_slots, self.record_size, self.o_direct_active)
        return list(map(RecoveredBlock._make, zip(keys, slots, seqs, strict=True)))

    def _setup_direct(self) -> None:
        if self._want_direct:
            fd, self.o_direct_reason = probe_o_direct(os.path.join(self.path, DATA_FILE), self._open_direct)
            if fd < 0:
                log.warning("disk tier: O_DIRECT requested but unusable, falling back to buffered I/O: %s",
                            self.o_direct_reason)
                return
            os.close(self._dfd)
            self._dfd, self.o_direct_active = fd, True

    def _open_direct(self, path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_DIRECT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))

    def _bounce(self) -> memoryview | None:
        """This thread's page-aligned buffer for O_DIRECT; None in buffered mode (zero copy)."""
        if not self.o_direct_active:
            return None
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = memoryview(mmap.mmap(-1, self.record_size))
        return buf

    def _write_batch_sync(self, items: list[tuple]) -> list[OSError | None]:
        """Write a batch of blocks (slot, key, seq, views): invalidations, data, commits; error per block."""
        prepared = [(slot, key, seq, views, payload_xxh(views)) for slot, key, seq, views in items]
        try:  # the old blocks stop being offered before their bytes change
            self._journal.before_write([p[0] for p in prepared], max(p[2] for p in prepared))
        except OSError as e:
            return [e] * len(items)
        errors: list[OSError | None] = []
        commits = []
        for slot, key, seq, views, psum in prepared:
            try:
                header = encode_header(slot, key, self._bpb, seq, psum)
                write_record(self._dfd, slot * self.record_size, header, views, self._bounce())
            except OSError as e:
                errors.append(e)
                continue
            errors.append(None)
            commits.append((slot, seq, key, psum))
        if commits:
            try:
                if self._fsync:
                    os.fdatasync(self._dfd)
                self._journal.commit(commits)
            except OSError as e:
                errors = [e if err is None else err for err in errors]
        return errors

    def _read_batch_sync(self, items: list[tuple]) -> list[str | OSError]:
        out: list[str | OSError] = []
        for slot, key, views in items:
            try:
                out.append(read_record(self._dfd, slot * self.record_size, slot, key, views, self._bounce()))
            except OSError as e:
                out.append(e)
        return out

    def _flush_sync(self) -> None:
        self._journal.before_write([], self._seq)
