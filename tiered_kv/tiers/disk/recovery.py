"""Restart recovery: replay journal.tkv in bounded chunks into per-slot arrays.

Memory is bounded by one chunk (4 MiB) plus the per-slot arrays, whatever the journal's size: a 2 GB
journal used to be read whole (2.7 GB RSS), a 20 GB one ended in MemoryError. Sparse holes are skipped
with SEEK_DATA, and records are prefiltered by kind with numpy before their checksums are computed, so
zeros (holes, preallocated tails) cost next to nothing. The chunks are read through aiofiles (seek and
readinto on the disk tier's executor), so the event loop never waits on them.

Rules, applied in journal order (a slot's records are in its write order):

* a record counts only if its xxh3 matches and its kind and key length make sense;
* a checksum-valid record whose seq is >= 2**63 is treated as corrupt and skipped (counted in
  ``bad_seq``): we never get near that many writes, and accepting it would leave no room for the next
  seq (a seq of 2**64-1 made every later write fail). Dropping the record costs at most a miss: the
  block header is re-verified on every read anyway;
* records for slots >= num_slots are dropped (the tier shrank);
* the last record of each slot wins (commit: live; invalidate: not);
* a key live in two slots (never written by us; a crafted or damaged journal) keeps the slot with the
  higher seq (ties: the higher slot); the other is freed and counted in ``duplicates``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .format import JCOMMIT, JDTYPE, JINVALIDATE, JREC_SIZE, journal_header

SEQ_LIMIT = 1 << 63  # seqs at or above this are corrupt by definition (see the module docstring)
READ_CHUNK = 4 << 20  # bytes per read; a multiple of JREC_SIZE
_KEY_OFF = 24  # byte offset of the key inside a journal record
_xxh = xxhash.xxh3_64_intdigest


@dataclass
class Replay:
    """What the journal says, slot by slot, and what had to be skipped to say it."""

    live: np.ndarray  # bool [num_slots]
    keys: np.ndarray  # uint8 [num_slots, key_bytes]
    seqs: np.ndarray  # uint64 [num_slots]
    psums: np.ndarray  # uint64 [num_slots]
    header_ok: bool = False
    size: int = 0  # bytes up to the end of the last whole record
    records: int = 0  # whole records after the header
    bad: int = 0  # failing checksum or sanity (holes and zeros included)
    torn_bytes: int = 0  # a partial record at the tail
    out_of_range: int = 0  # valid records of slots >= num_slots
    bad_seq: int = 0  # checksum-valid records with seq >= SEQ_LIMIT, skipped
    duplicates: int = 0  # live slots freed because another slot holds the same key with a higher seq
    max_seq: int = 0

    @property
    def untidy(self) -> bool:
        """True when compaction would drop something (the journal is not just live commits)."""
        return bool(self.bad or self.out_of_range or self.bad_seq or self.duplicates)

    def live_slots(self) -> np.ndarray:
        """Live slots, oldest -> newest by seq."""
        slots = np.flatnonzero(self.live)
        return slots[np.argsort(self.seqs[slots], kind="stable")]


def empty_replay(num_slots: int, key_bytes: int) -> Replay:
    return Replay(np.zeros(num_slots, bool), np.zeros((num_slots, key_bytes), np.uint8),
                  np.zeros(num_slots, np.uint64), np.zeros(num_slots, np.uint64))


async def replay_journal(f: Any, key_bytes: int, num_slots: int, *, chunk: int = READ_CHUNK) -> Replay:
    """Replay the journal open as ``f``, an aiofiles binary file (seek and readinto only; nothing changed)."""
    steps = _replay(key_bytes, num_slots, chunk)
    try:
        step = next(steps)
        while True:
            if step[0] == "size":
                answer = await f.seek(0, os.SEEK_END)
            elif step[0] == "read":
                await f.seek(step[1])
                answer = await f.readinto(step[2]) or 0
            else:
                try:
                    answer = await f.seek(step[1], os.SEEK_DATA)
                except OSError as e:
                    answer = _no_data(e, step[1])
            step = steps.send(answer)
    except StopIteration as done:
        return done.value


def replay_journal_fd(fd: int, key_bytes: int, num_slots: int, *, chunk: int = READ_CHUNK) -> Replay:
    """The same replay with plain preads on ``fd``, for ``tiered-kv disk ls`` (which has no event loop)."""
    steps = _replay(key_bytes, num_slots, chunk)
    try:
        step = next(steps)
        while True:
            if step[0] == "size":
                answer = os.fstat(fd).st_size
            elif step[0] == "read":
                answer = os.preadv(fd, [step[2]], step[1])
            else:
                try:
                    answer = os.lseek(fd, step[1], os.SEEK_DATA)
                except OSError as e:
                    answer = _no_data(e, step[1])
            step = steps.send(answer)
    except StopIteration as done:
        return done.value


def _no_data(e: OSError, off: int) -> int | None:
    """SEEK_DATA failed: ENXIO means nothing but hole from ``off`` on (None); otherwise the file system
    cannot tell, so read from ``off``."""
    return None if e.errno == errno.ENXIO else off


def _replay(key_bytes: int, num_slots: int, chunk: int) -> Generator[tuple, Any, Replay]:
    """The replay without its I/O. Yields what it needs, and is sent the answer: ("size",) -> the file's
    size; ("read", off, buf) -> how many bytes were read into ``buf`` from ``off``; ("data", off) -> the
    first data offset at or after ``off`` (SEEK_DATA), None when only hole follows."""
    r = empty_replay(num_slots, key_bytes)
    file_size = yield ("size",)
    head = bytearray(JREC_SIZE)
    got = (yield ("read", 0, memoryview(head))) if file_size >= JREC_SIZE else 0
    r.header_ok = got == JREC_SIZE and head == journal_header(key_bytes)
    if not r.header_ok:
        r.size = file_size
        return r
    r.records, r.torn_bytes = divmod(file_size - JREC_SIZE, JREC_SIZE)
    end = JREC_SIZE + r.records * JREC_SIZE
    r.size = end
    chunk = max(JREC_SIZE, chunk // JREC_SIZE * JREC_SIZE)
    buf = bytearray(chunk)
    off = JREC_SIZE
    while off < end:
        data_at = _record_boundary((yield ("data", off)), off, end) if hasattr(os, "SEEK_DATA") else off
        if data_at > off:  # a hole: all zero records, none valid
            r.bad += (data_at - off) // JREC_SIZE
            off = data_at
            continue
        want = min(chunk, end - off)
        n = (yield ("read", off, memoryview(buf)[:want])) // JREC_SIZE
        if n == 0:  # the file shrank under us: what is left counts as torn
            r.bad += (end - off) // JREC_SIZE
            break
        _apply_chunk(r, memoryview(buf)[: n * JREC_SIZE], n, key_bytes, num_slots)
        off += n * JREC_SIZE
    _resolve_duplicates(r)
    return r


def _record_boundary(at: int | None, off: int, end: int) -> int:
    """The first record boundary >= off that may hold data, given SEEK_DATA's answer ``at``."""
    if at is None:
        return end
    at = min(at, end)
    return max(off, JREC_SIZE + (at - JREC_SIZE) // JREC_SIZE * JREC_SIZE)


def _apply_chunk(r: Replay, mv: memoryview, n: int, key_bytes: int, num_slots: int) -> None:
    arr = np.frombuffer(mv, dtype=JDTYPE, count=n)
    kind = arr["kind"]
    cand = np.flatnonzero(((kind == JCOMMIT) & (arr["key_len"] == key_bytes)) | (kind == JINVALIDATE))
    sums = np.fromiter((_xxh(mv[i * JREC_SIZE : i * JREC_SIZE + JREC_SIZE - 8]) for i in cand.tolist()),
                       dtype=np.uint64, count=len(cand))
    v = arr[cand[sums == arr["xxh"][cand]]]
    r.bad += n - len(v)
    if not len(v):
        return
    sane = v["seq"] < SEQ_LIMIT
    r.bad_seq += int(len(v) - sane.sum())
    v = v[sane]
    if len(v):
        r.max_seq = max(r.max_seq, int(v["seq"].max()))
    in_range = v["slot"] < num_slots
    r.out_of_range += int(len(v) - in_range.sum())
    v = v[in_range]
    if not len(v):
        return
    rev = v[::-1]  # np.unique keeps the first hit: in reversed order that is the slot's last record
    _, first = np.unique(rev["slot"], return_index=True)
    last = rev[first]
    gone = last[last["kind"] == JINVALIDATE]["slot"]
    r.live[gone] = False
    com = last[last["kind"] == JCOMMIT]
    slots = com["slot"]
    r.live[slots] = True
    r.seqs[slots], r.psums[slots] = com["seq"], com["psum"]
    r.keys[slots] = com.view(np.uint8).reshape(len(com), JREC_SIZE)[:, _KEY_OFF : _KEY_OFF + key_bytes]


def _resolve_duplicates(r: Replay) -> None:
    slots = np.flatnonzero(r.live)
    if len(slots) < 2:
        return
    kb = r.keys.shape[1]
    keys = np.ascontiguousarray(r.keys[slots]).view(f"V{kb}").ravel()
    uniq, group = np.unique(keys, return_inverse=True)
    if len(uniq) == len(slots):
        return
    group = group.ravel()
    order = np.lexsort((slots, r.seqs[slots], group))  # by key, then seq, then slot: a group's last wins
    g = group[order]
    loses = np.zeros(len(order), bool)
    loses[:-1] = g[:-1] == g[1:]
    losers = slots[order[loses]]
    r.live[losers] = False
    r.duplicates = len(losers)
