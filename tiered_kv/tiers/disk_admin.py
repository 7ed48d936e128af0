"""Namespace directories of the disk tier: create/verify one safely, its journal, list them, remove them.

Used by DiskStore (``prepare_namespace_dir``, ``Journal``) and by ``tiered-kv disk ls|gc PATH``. Deletion is
deliberately narrow: only a directory named ``ns-<20 hex>`` that is not a symlink, whose namespace.json is
ours and hashes to that very name, that holds nothing but our files, and that no DiskStore has open.
All of it is synchronous file-system work; DiskStore calls it on its executor.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk_format import (
    DATA_FILE,
    JCOMMIT,
    JINVALIDATE,
    JOURNAL_FILE,
    JREC_SIZE,
    LOCK_FILE,
    NS_FILE,
    DiskNamespace,
    encode_journal,
    jrecord,
    namespace_json,
    open_private,
    parse_namespace_json,
    pwrite_all,
    read_all,
    read_small,
    replace_file,
    scan_journal,
)

log = logging.getLogger("tiered_kv.disk")
NS_DIR_RE = re.compile(r"^ns-[0-9a-f]{20}$")
# Everything a namespace dir may hold (temp files are left by a kill during an atomic replace).
OUR_FILES = frozenset({NS_FILE, NS_FILE + ".tmp", DATA_FILE, JOURNAL_FILE, JOURNAL_FILE + ".tmp", LOCK_FILE})
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)  # the root the user named may be a link
_DIR_FLAGS = _ROOT_FLAGS | getattr(os, "O_NOFOLLOW", 0)  # entries under it never are


@dataclass(frozen=True)
class NamespaceInfo:
    dirname: str
    model_id: str
    dtype: str
    layout_digest: str
    bytes_per_block: int
    size_bytes: int  # allocated on disk (the data file is sparse)
    blocks: int  # committed blocks in the journal
    key_bytes: int = 32


# ---- opening one (DiskStore) -----------------------------------------------------------------------
def check_dir(path: str, *, create_parents: bool, allow_symlink: bool) -> None:
    """Make sure ``path`` is a writable directory (created 0700), refusing a symlink unless allowed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            (os.makedirs if create_parents else os.mkdir)(path, 0o700)
            os.chmod(path, 0o700)
            st = os.lstat(path)
        except OSError as e:
            raise DiskError(e.errno, f"cannot create disk tier directory: {e.strerror}", path) from e
    if stat.S_ISLNK(st.st_mode):
        if not allow_symlink:
            raise DiskError(errno.ELOOP, "disk tier path is a symlink (set allow_symlink to use it)", path)
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskError(errno.ENOTDIR, "disk tier path is not a directory", path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise DiskError(errno.EACCES, "disk tier directory is not writable", path)


def prepare_namespace_dir(root: str, ns: DiskNamespace, *, allow_symlink: bool) -> int:
    """Create or verify root/ns-dir and its namespace.json; return the fd holding the directory's flock."""
    check_dir(root, create_parents=True, allow_symlink=allow_symlink)
    path = os.path.join(root, ns.dirname())
    check_dir(path, create_parents=False, allow_symlink=allow_symlink)
    lock_fd = open_private(os.path.join(path, LOCK_FILE))
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskError(errno.EBUSY, "namespace dir is in use by another DiskStore", path) from None
        nsp = os.path.join(path, NS_FILE)
        try:
            raw = read_small(nsp)
        except FileNotFoundError:
            os.close(replace_file(path, NS_FILE, namespace_json(ns, time.time()), fsync=True))
            return lock_fd
        try:
            on_disk, _ = parse_namespace_json(raw)
        except ValueError as e:
            raise DiskError(errno.EINVAL, f"unusable namespace.json ({e}); refusing to reuse it", nsp) from e
        if on_disk != ns:
            diff = {k: (getattr(on_disk, k), getattr(ns, k)) for k in ns.__dataclass_fields__
                    if getattr(on_disk, k) != getattr(ns, k)}
            raise DiskError(errno.EEXIST, f"namespace.json disagrees with this store (on disk, wanted): {diff}", nsp)
    except BaseException:
        os.close(lock_fd)
        raise
    return lock_fd


# ---- ls / gc ---------------------------------------------------------------------------------------------
def _read_ours(dir_fd: int, dirname: str) -> DiskNamespace | None:
    """The namespace of an open ns dir, or None unless its namespace.json is ours and matches its name."""
    try:
        ns, _ = parse_namespace_json(read_small(NS_FILE, dir_fd=dir_fd))
    except (OSError, ValueError):
        return None
    return ns if ns.dirname() == dirname else None


def _open_ns_dir(root_fd: int, name: str) -> int | None:
    if not NS_DIR_RE.match(name):
        return None
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=root_fd)  # O_NOFOLLOW: a symlinked entry fails here
    except OSError:
        return None


def list_namespaces(root: str | os.PathLike) -> list[NamespaceInfo]:
    """Namespaces under ``root`` (entries that are not ours are ignored), sorted by dirname."""
    out = []
    root_fd = os.open(os.fspath(root), _ROOT_FLAGS)
    try:
        for name in sorted(os.listdir(root_fd)):
            if (dfd := _open_ns_dir(root_fd, name)) is None:
                continue
            try:
                if (ns := _read_ours(dfd, name)) is None:
                    continue
                size = sum(os.stat(f, dir_fd=dfd, follow_symlinks=False).st_blocks * 512
                           for f in os.listdir(dfd) if f in OUR_FILES)
                blocks = 0
                try:
                    jfd = os.open(JOURNAL_FILE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
                    try:
                        blocks = len(scan_journal(read_all(jfd), ns.key_bytes).slots)
                    finally:
                        os.close(jfd)
                except FileNotFoundError:
                    pass
                out.append(NamespaceInfo(name, ns.model_id, ns.dtype, ns.layout_digest, ns.bytes_per_block,
                                         size, blocks, ns.key_bytes))
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)
    return out


def is_stale(info: NamespaceInfo, current: DiskNamespace | None) -> bool:
    """True unless ``info`` is the namespace in use now (with no current namespace, everything is stale)."""
    return current is None or info.dirname != current.dirname()


def remove_namespaces(root: str | os.PathLike, dirnames: list[str]) -> list[str]:
    """Delete the given namespace dirs; returns the names removed.

    Every name is checked before anything is deleted; DiskError (nothing removed) if one is not a
    namespace dir of ours, holds files we did not create, or is open by a DiskStore.
    """
    root_fd = os.open(os.fspath(root), _ROOT_FLAGS)
    held: list[tuple[str, int, int, list[str]]] = []  # name, dir fd, lock fd, files
    try:
        for name in dict.fromkeys(dirnames):
            path = os.path.join(os.fspath(root), name)
            if (dfd := _open_ns_dir(root_fd, name)) is None:
                raise DiskError(errno.ENOENT, "not a namespace directory (or a symlink)", path)
            held.append((name, dfd, -1, []))
            if _read_ours(dfd, name) is None:
                raise DiskError(errno.EINVAL, "no valid tiered_kv namespace.json here; refusing to delete", path)
            files = os.listdir(dfd)
            if foreign := sorted(set(files) - OUR_FILES):
                raise DiskError(errno.ENOTEMPTY, f"holds files tiered_kv did not create {foreign}; not deleting", path)
            lfd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600, dir_fd=dfd)
            held[-1] = (name, dfd, lfd, files)
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DiskError(errno.EBUSY, "namespace is open by a DiskStore; not deleting", path) from None
        for name, dfd, _lfd, files in held:
            # namespace.json last: a dir half-removed by a crash is still recognisable as ours.
            for f in sorted(set(files) | {LOCK_FILE}, key=lambda f: f == NS_FILE):
                try:
                    os.unlink(f, dir_fd=dfd)
                except FileNotFoundError:
                    pass
            os.rmdir(name, dir_fd=root_fd)
        return [name for name, *_ in held]
    finally:
        for _name, dfd, lfd, _files in held:
            for fd in (lfd, dfd):
                if fd >= 0:
                    os.close(fd)
        os.close(root_fd)


# ---- the journal -------------------------------------------------------------------------------------
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
