"""The disk tier's journal: commit/invalidate records that make restart recovery a bulk parse.

See disk_format.py for the record layout and disk_store.py for the write protocol that orders
invalidate -> data -> commit.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

import numpy as np

from tiered_kv.tiers.disk_format import (
    JCOMMIT,
    JINVALIDATE,
    JOURNAL_FILE,
    JREC_SIZE,
    encode_journal,
    jrecord,
    open_private,
    pwrite_all,
    read_all,
    replace_file,
    scan_journal,
)

log = logging.getLogger("tiered_kv.disk")


class Journal:
    """journal.tkv plus an in-memory mirror of its committed slots (key, seq, checksum).

    Called only from the store's executor threads, which hold ``lock``; ``queue_invalidate`` alone is
    lock-free (a deque append) so the event loop never waits. Records are written with pwrite at our own
    offset, not O_APPEND: a failed append is cut off and overwritten by the next, so records stay aligned
    even after ENOSPC. Compaction rewrites the journal from the mirror (temp file + os.replace).
    """

    def __init__(self, dirpath: str, key_bytes: int, num_slots: int, *, fsync: bool, compact_slack: int):
        self.dir, self.kb, self.fsync, self.compact_slack = dirpath, key_bytes, fsync, compact_slack
        self.lock = threading.Lock()
        self.fd = -1
        self.size = self.records = self.nlive = self.max_seq = self.retry_at = 0
        self.pending: deque[int] = deque()
        self.live = np.zeros(num_slots, bool)
        self.keys = np.zeros((num_slots, key_bytes), np.uint8)
        self.seqs = np.zeros(num_slots, np.uint64)
        self.psums = np.zeros(num_slots, np.uint64)

    def load(self) -> tuple[list[bytes], list[int], list[int]]:
        """Recover (keys, slots, seqs) of committed slots < num_slots, oldest first; compact when untidy."""
        try:
            os.unlink(os.path.join(self.dir, JOURNAL_FILE + ".tmp"))  # a compaction killed midway
        except FileNotFoundError:
            pass
        self.fd = open_private(os.path.join(self.dir, JOURNAL_FILE))
        raw = read_all(self.fd)
        scan = scan_journal(raw, self.kb)
        keep = scan.slots < len(self.live)
        slots, seqs, keys = scan.slots[keep], scan.seqs[keep], scan.keys[keep]
        self.live[slots] = True
        self.keys[slots], self.seqs[slots], self.psums[slots] = keys, seqs, scan.psums[keep]
        self.nlive, self.max_seq, self.records = len(slots), scan.max_seq, scan.records
        self.size = len(raw) - scan.torn_bytes
        if scan.torn_bytes:  # cut the torn tail so the next append lands on a record boundary
            os.ftruncate(self.fd, self.size)
        if not scan.header_ok:
            self._compact()  # a journal we cannot append to: rewrite it or fail the open
        elif scan.bad or not keep.all() or self._too_big():
            self._try_compact()
        kbytes, kb = keys.tobytes(), self.kb
        return [kbytes[i : i + kb] for i in range(0, len(kbytes), kb)], slots.tolist(), seqs.tolist()

    def queue_invalidate(self, slot: int) -> None:
        self.pending.append(slot)

    def before_write(self, slots: list[int], seq: int) -> None:
        """Journal queued invalidations and those of ``slots`` that hold commits, before their bytes change."""
        with self.lock:
            slots = [self.pending.popleft() for _ in range(len(self.pending))] + slots
            slots = [s for s in dict.fromkeys(slots) if self.live[s]]  # only commits need a record
            if not slots:
                return
            try:
                self._append(b"".join(jrecord(JINVALIDATE, s, seq) for s in slots))
            except OSError:
                self.pending.extend(slots)  # retried at the next journal write
                raise
            self.live[slots] = False
            self.nlive -= len(slots)

    def commit(self, commits: list[tuple[int, int, bytes, int]]) -> None:
        """Journal (slot, seq, key, payload xxh3) commits, in one write, once their bytes are written."""
        with self.lock:
            self._append(b"".join(jrecord(JCOMMIT, slot, seq, key, psum) for slot, seq, key, psum in commits))
            for slot, seq, key, psum in commits:
                self.nlive += not self.live[slot]
                self.live[slot], self.seqs[slot], self.psums[slot] = True, seq, psum
                self.keys[slot] = np.frombuffer(key, np.uint8)
            if self._too_big():
                self._try_compact()

    def close(self) -> None:
        with self.lock:
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)

    def _too_big(self) -> bool:
        return self.records > max(2 * self.nlive + self.compact_slack, self.retry_at)

    def _try_compact(self) -> None:
        """Compaction is housekeeping: if it fails (a full disk), keep appending and retry much later."""
        try:
            self._compact()
        except OSError as e:
            self.retry_at = 2 * self.records
            log.warning("disk tier: journal compaction in %s failed (%s); will retry later", self.dir, e)

    def _append(self, data: bytes) -> None:
        try:
            pwrite_all(self.fd, [data], self.size, len(data))
            if self.fsync:
                os.fdatasync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass
            raise
        self.size += len(data)
        self.records += len(data) // JREC_SIZE

    def _compact(self) -> None:
        live = np.flatnonzero(self.live)
        live = live[np.argsort(self.seqs[live], kind="stable")]
        blob = encode_journal(self.kb, live, self.seqs[live], self.psums[live], self.keys[live])
        fd = replace_file(self.dir, JOURNAL_FILE, blob, fsync=self.fsync)
        old, self.fd = self.fd, fd
        if old >= 0:
            os.close(old)
        self.size, self.records = len(blob), len(live)
