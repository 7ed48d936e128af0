"""The disk tier's journal: commit/invalidate records that make restart recovery a bulk parse.

See format.py for the record layout, recovery.py for how a journal is replayed, and store.py for the
write protocol that orders invalidate -> data -> commit. A batch of blocks costs two appends (one for its
invalidations plus whatever ``invalidate_many`` queued, one for its commits), both made by the batch's ONE
executor job (batch_job.py) through the journal's fd; ``flush`` / ``aclose`` append through the aiofiles file.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections import deque
from collections.abc import Callable

import numpy as np
from aiofiles.threadpool.binary import AsyncFileIO

from tiered_kv.errors import DiskError

from .aio import DiskCalls
from .batch_job import BatchJob, Tail
from .format import JINVALIDATE, JOURNAL_FILE, JREC_SIZE, encode_journal, encode_records
from .recovery import READ_CHUNK, empty_replay, replay_journal

log = logging.getLogger("tiered_kv.disk")


def journal_limit(num_slots: int, floor: int) -> int:
    """The most bytes the journal may hold: compaction keeps it near 2 records per live slot, so 4 per
    slot (or ``floor``) is only reached when compaction keeps failing; then writes stop instead."""
    return max(floor, 4 * num_slots * JREC_SIZE)


class Journal:
    """journal.tkv plus an in-memory mirror of its committed slots (key, seq, checksum).

    Runs on the event loop; its file I/O runs on the store's executor (aio.py): a batch's two appends in
    that batch's one job (``write_batch``), the rest through aiofiles. ``queue_invalidate`` is a plain
    deque append. Records go at our own offset (``size``; ``tail`` while batch jobs are in flight), not
    O_APPEND: a failed append is cut off and overwritten by the next, so records stay aligned even after
    ENOSPC. The mirror is only updated on the loop, from what each job reports. Compaction rewrites the
    journal from the mirror (temp file, fsync, rename over, fsync of the directory) under ``lock`` once no
    batch job is in flight (``_quiesce``): then the mirror is exactly the net effect of the records written
    so far, and no job still holds the old file's fd.
    """

    def __init__(self, dirpath: str, key_bytes: int, num_slots: int, *, fsync: bool, compact_slack: int,
                 limit: int) -> None:
        self.dir, self.kb, self.fsync, self.compact_slack, self.limit = dirpath, key_bytes, fsync, compact_slack, limit
        self.path = os.path.join(dirpath, JOURNAL_FILE)
        self.read_chunk = READ_CHUNK
        self.lock = asyncio.Lock()
        self.file: AsyncFileIO | None = None
        self.calls: DiskCalls | None = None
        self.fd = self.dir_fd = -1
        self.size = self.records = self.nlive = self.max_seq = self.retry_at = 0
        self.appends = 0  # record writes (one per batch of invalidations or commits): for tests and benches
        self.pending: deque[np.ndarray] = deque()  # slot arrays queued by invalidate_many
        self.tail = Tail()  # where the batch jobs in flight append
        self._jobs = self._reserved = 0  # batch jobs in flight, the journal bytes they may still append
        self._idle = asyncio.Event()
        self._idle.set()
        self.num_slots = num_slots
        empty = empty_replay(0, key_bytes)  # the per-slot mirror comes from load()
        self.live, self.keys, self.seqs, self.psums = empty.live, empty.keys, empty.seqs, empty.psums
        self.issues: dict[str, tuple[int, str]] = {}  # cause -> (blocks dropped by recovery, detail)

    async def load(self, calls: DiskCalls, dir_fd: int) -> tuple[list[bytes], list[int], list[int]]:
        """Recover (keys, slots, seqs) of committed slots < num_slots, oldest first; compact when untidy."""
        self.calls, self.dir_fd = calls, dir_fd
        try:
            await calls.unlink(JOURNAL_FILE + ".tmp", dir_fd=dir_fd)  # a compaction killed midway
        except FileNotFoundError:
            pass
        self._use(await calls.open(JOURNAL_FILE, dir_fd=dir_fd, path=self.path))
        r = await replay_journal(self.file, self.kb, self.num_slots, chunk=self.read_chunk)
        self.live, self.keys, self.seqs, self.psums = r.live, r.keys, r.seqs, r.psums
        self.nlive, self.max_seq, self.records, self.size = int(r.live.sum()), r.max_seq, r.records, r.size
        if r.bad_seq:
            self.issues["journal_bad_seq"] = (r.bad_seq, "checksum-valid journal records with seq >= 2**63, "
                                              "treated as corrupt and skipped")
        if r.duplicates:
            self.issues["journal_duplicate_key"] = (r.duplicates, "a key committed in two slots; the higher "
                                                    "seq kept, the other slot freed")
        if r.torn_bytes:  # cut the torn tail so the next append lands on a record boundary
            await self.file.truncate(self.size)
        await self.file.seek(self.size)  # appends go on from here (the replay moved the position)
        if not r.header_ok:
            await self._compact()  # a journal we cannot append to: rewrite it or fail the open
        elif r.untidy or self._too_big():
            await self._try_compact()
        slots = r.live_slots()
        kbytes, kb = self.keys[slots].tobytes(), self.kb
        keys = [kbytes[i : i + kb] for i in range(0, len(kbytes), kb)]
        return keys, slots.tolist(), self.seqs[slots].tolist()

    def queue_invalidate(self, slots: np.ndarray) -> None:
        self.pending.append(slots)

    async def before_write(self, slots: np.ndarray, seq: int) -> None:
        """Journal queued invalidations and those of ``slots`` that hold commits, in one append, before
        their bytes change."""
        async with self.lock:
            await self._quiesce()
            todo = self._invalidations(slots)
            if not len(todo):
                return
            try:
                await self._append(encode_records(JINVALIDATE, todo, seq))
            except OSError:
                self.pending.append(todo)  # retried at the next journal write
                raise
            self.live[todo] = False
            self.nlive -= len(todo)

    def _invalidations(self, slots: np.ndarray) -> np.ndarray:
        """What the next append must invalidate: the queued slots and ``slots``, those holding commits
        (taken off the queue: a failed append puts them back)."""
        queued = [self.pending.popleft() for _ in range(len(self.pending))]
        todo = np.unique(np.concatenate([*queued, slots]).astype(np.int64)) if queued else slots
        return todo[self.live[todo]]  # only commits need a record

    async def write_batch(self, slots: np.ndarray, seqs: np.ndarray, keys: np.ndarray,
                          write_data: Callable[[], tuple[np.ndarray, int]]) -> int:  # fmt: skip
        """One batch of distinct ``slots`` (keys: uint8 [n, key_bytes]) in ONE executor job (batch_job.py):
        its invalidations (plus whatever ``invalidate_many`` queued), ``write_data()`` (returns the payload
        checksums and the data syscalls), its commits; returns the data syscalls.

        The bookkeeping stays on the loop: under ``lock`` before the job (which slots need records, room
        in the journal, compaction at the bound), and the mirror after it. The lock is not held while the
        job runs, so batches of other slots (O_DIRECT: they overlap their data writes) run beside it; their
        appends take turns on the shared ``tail``, and whatever needs the journal to itself (compaction,
        ``before_write``, close) waits for the jobs in flight first (``_quiesce``).
        """
        async with self.lock:
            todo = self._invalidations(slots)
            nbytes = (len(todo) + len(slots)) * JREC_SIZE
            try:
                if self.size + self._reserved + nbytes > self.limit:
                    await self._quiesce()
                    await self._make_room(nbytes)
            except OSError:
                self.pending.append(todo)  # retried at the next journal write
                raise
            if not self._jobs:  # nothing in flight: the tail is where our own bookkeeping says
                self.tail.end = self.size
            job = BatchJob(self.fd, self.tail, self.fsync, todo, int(seqs.max()), slots, seqs, keys, write_data)
            self._jobs, self._reserved = self._jobs + 1, self._reserved + nbytes
            self._idle.clear()
        try:
            syscalls = await self.calls.run(job)
        finally:  # no await from here to the mirror's update: a quiesced journal is a settled one
            self._jobs, self._reserved = self._jobs - 1, self._reserved - nbytes
            if not self._jobs:
                self._idle.set()
            self._settle(job, todo, slots, seqs, keys)
        if self._too_big():
            async with self.lock:
                await self._quiesce()
                if self._too_big():  # another batch may have compacted meanwhile
                    await self._try_compact()
        return syscalls

    def _settle(self, job: BatchJob, todo: np.ndarray, slots: np.ndarray, seqs: np.ndarray, keys: np.ndarray) -> None:
        """The mirror after a batch job, from how far it got (it may have raised)."""
        self.appends += job.appends
        if job.inv_done:
            self._appended(job.inv_bytes)
            # count what is still live: a batch beside this one may have journaled a queued slot too
            self.nlive -= int(np.count_nonzero(self.live[todo]))
            self.live[todo] = False
        elif len(todo):
            self.pending.append(todo)  # the old blocks are intact: retried at the next journal write
        if job.commit_done:
            self._appended(job.commit_bytes)
            self.nlive += int(np.count_nonzero(~self.live[slots]))
            self.live[slots], self.seqs[slots], self.psums[slots], self.keys[slots] = True, seqs, job.psums, keys

    async def _quiesce(self) -> None:
        """Wait (holding ``lock``, so no batch starts) until no batch job is in flight."""
        while self._jobs:
            await self._idle.wait()

    async def close(self) -> None:
        async with self.lock:
            await self._quiesce()
            f, self.file, self.fd = self.file, None, -1
            if f is not None:
                await f.close()

    def _use(self, f: AsyncFileIO) -> None:
        self.file, self.fd = f, f.fileno()

    def _too_big(self) -> bool:
        return self.records > max(2 * self.nlive + self.compact_slack, self.retry_at) or self.size > self.limit

    async def _try_compact(self) -> None:
        """Compaction is housekeeping: if it fails (a full disk), keep appending and retry much later."""
        try:
            await self._compact()
        except OSError as e:
            self.retry_at = 2 * self.records
            log.warning("disk tier: journal compaction in %s failed (%s); will retry later", self.dir, e)

    async def _make_room(self, nbytes: int) -> None:
        if self.size + nbytes > self.limit:
            try:  # at the bound compaction is no longer optional: without it the journal grows forever
                await self._compact()
            except OSError as e:
                raise DiskError(e.errno or errno.EIO, f"journal reached its bound of {self.limit} bytes and "
                                f"cannot be compacted: {e.strerror or e}", self.path) from e

    def _appended(self, nbytes: int) -> None:
        self.size += nbytes
        self.records += nbytes // JREC_SIZE

    async def _append(self, data: bytes) -> None:
        """One append through the aiofiles file's position (flush, aclose: off the hot path)."""
        await self._make_room(len(data))
        try:
            self.appends += 1
            await self.calls.write_all(self.file, data)
            if self.fsync:
                await self.calls.fdatasync(self.fd)
        except OSError:
            try:  # cut what got written ...
                await self.file.truncate(self.size)
            except OSError:
                pass
            try:  # ... and in any case append at the record boundary next time
                await self.file.seek(self.size)
            except OSError:
                pass
            raise
        self._appended(len(data))

    async def _compact(self) -> None:
        live = np.flatnonzero(self.live)
        live = live[np.argsort(self.seqs[live], kind="stable")]
        blob = encode_journal(self.kb, live, self.seqs[live], self.psums[live], self.keys[live])
        new = await self.calls.replace_file(self.dir_fd, self.dir, JOURNAL_FILE, blob)  # rare: always durable
        old = self.file
        self._use(new)
        if old is not None:
            await old.close()
        self.size, self.records = len(blob), len(live)
