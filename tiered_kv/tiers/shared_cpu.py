"""The CPU tier in shared memory: one file per engine instance that the scheduler and every TP rank map.

Rows are slot-major and rank-interleaved: slot s is one row of ``world_size * shard_bytes`` bytes and
rank r's shard of it is bytes ``[r * shard_bytes, (r + 1) * shard_bytes)``. The scheduler's disk and
remote tiers move whole rows, so a record always holds every rank's shard of its block.

The file holds users' prompts as KV, so it is created 0600 with O_EXCL, and one that exists with another
owner, a wider mode, a link or a second hard link is refused by the disk tier's rules (tiers/disk/files.py).

Liveness is a flock: every process that maps a segment holds LOCK_SH on it. Whoever creates a segment
first scans the directory for ours: one it can lock LOCK_EX has no live holder (its engine was killed), so
it is unlinked unread and the CPU tier starts empty. A per-user lock file serialises scan and create, so a
segment is never seen between its creation and its creator's LOCK_SH.

A header page lets every attacher check its own numbers (magic, version, world_size, shard_bytes,
num_slots, layout digest); the ``ready`` word is written last, so a half-made segment never attaches.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, DiskError, LayoutError
from ..sizes import format_size
from .disk.files import DIR_FLAGS, check_trusted_dir, open_regular

log = logging.getLogger(__name__)

PREFIX, SUFFIX = "tkv-", ".kv"
SETTING = "tiers.cpu.shared_path"
HEADER_BYTES = 4096  # one page: the rows start page-aligned
MAGIC, VERSION, READY = b"TKVSHM\x00\x01", 1, 0x52454459
# magic, version, world_size, shard_bytes, num_slots, scheduler pid, ready
_HEADER = struct.Struct("<8sIIQQII")
_PID_AT, _READY_AT = _HEADER.size - 8, _HEADER.size - 4
_WHAT = "shared CPU tier segment"


@dataclass(frozen=True)
class SegmentInfo:
    """A segment's path and geometry. The scheduler and each worker compute it from the same inputs
    (split.scheduler.segment_info_for); whoever opens second checks it against the header."""

    path: str
    world_size: int
    shard_bytes: int
    num_slots: int

    @classmethod
    def for_engine(cls, directory: str, engine_id: str, *, world_size: int, shard_bytes: int,
                   num_slots: int) -> SegmentInfo:  # fmt: skip
        for what, value in (("world_size", world_size), ("shard_bytes", shard_bytes), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"shared CPU tier: {what} must be an int >= 1, got {value!r}")
        return cls(os.path.join(directory, segment_name(engine_id)), world_size, shard_bytes, num_slots)

    @property
    def row_bytes(self) -> int:
        return self.world_size * self.shard_bytes

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.num_slots * self.row_bytes


def segment_name(name: str) -> str:
    """The file name of an engine instance's segment (characters a file name should not hold replaced)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"the shared CPU tier needs a non-empty engine instance name, got {name!r}")
    return PREFIX + re.sub(r"[^A-Za-z0-9._-]", "_", name)[:200] + SUFFIX


class SharedSegment:
    """A mapped segment; build it with ``open`` (create or attach)."""

    def __init__(self, info: SegmentInfo, lock_fd: int, map_fd: int) -> None:
        self.info = info
        # Two opens of the file: the flock lives on ``lock_fd`` alone, so closing it ends our liveness
        # claim even while numpy/torch views keep the mapping (which holds a dup of ``map_fd``) alive.
        self._fd = lock_fd
        self._ino = os.fstat(lock_fd).st_ino
        self._claimed = False
        self._map: mmap.mmap | None = mmap.mmap(map_fd, info.file_bytes, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        self.rows = np.frombuffer(self._map, dtype=np.uint8, count=info.num_slots * info.row_bytes,
                                  offset=HEADER_BYTES).reshape(info.num_slots, info.row_bytes)  # fmt: skip

    @classmethod
    def open(cls, info: SegmentInfo, *, scheduler: bool = False, create: bool = True) -> SharedSegment:
        """Attach to the segment, or create it (reclaiming dead ones first) when it does not exist.

        An existing one must be ours, 0600, one link, and hold exactly ``info``'s geometry (LayoutError
        naming both numbers otherwise). ``scheduler``: claim it for this process; a second live
        scheduler on one segment (two engines sharing an engine id) is a ConfigError.
        """
        directory, fname = os.path.split(info.path)
        dfd = _open_dir(directory)
        try:
            with _DirLock(dfd, directory):
                _reclaim(dfd, directory)
                created = False
                try:
                    fd = _open_file(fname, dfd, info.path, os.O_RDWR)
                except FileNotFoundError:
                    if not create:
                        raise LayoutError(f"the shared CPU tier segment {info.path} does not exist (has its "
                                          f"engine exited?)") from None  # fmt: skip
                    _preflight(dfd, directory, info.file_bytes)
                    fd = _open_file(fname, dfd, info.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                    created = True
                return cls._map_locked(info, fd, dfd, fname, created, scheduler)
        finally:
            os.close(dfd)

    @classmethod
    def _map_locked(cls, info: SegmentInfo, fd: int, dfd: int, fname: str, created: bool,
                    scheduler: bool) -> SharedSegment:  # fmt: skip
        seg = None
        try:
            if created:
                os.fchmod(fd, 0o600)  # O_CREAT's mode went through the umask
            else:
                _check_private(os.fstat(fd), info.path)
            fcntl.flock(fd, fcntl.LOCK_SH)  # alive from here on
            if created:
                _reserve(fd, info, os.path.dirname(info.path))
            else:
                _check_header(os.pread(fd, _HEADER.size, 0), info)
                if os.fstat(fd).st_size < info.file_bytes:
                    raise LayoutError(f"{info.path} holds {os.fstat(fd).st_size} bytes, less than the "
                                      f"{info.file_bytes} its header describes")  # fmt: skip
            map_fd = _open_file(fname, dfd, info.path, os.O_RDWR)
            try:
                seg = cls(info, fd, map_fd)
            finally:
                os.close(map_fd)
            if created:
                seg._write_header()
            if scheduler:
                seg._claim()
            return seg
        except BaseException:
            if seg is not None:
                seg._fd = -1
            os.close(fd)
            if created:
                os.unlink(fname, dir_fd=dfd)
            raise

    # -- views ----------------------------------------------------------------------------
    def shard(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s bytes of every slot: ``uint8[num_slots, shard_bytes]``, rows strided by the row size."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.info.world_size:
            raise LayoutError(f"rank {rank!r} is outside the segment's TP group of world_size {self.info.world_size}")
        b = self.info.shard_bytes
        return self.rows[:, rank * b : (rank + 1) * b]

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Detach; the last process out removes the file. Idempotent.

        The mapping itself goes once no numpy or torch view of it is left.
        """
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        directory, fname = os.path.split(self.info.path)
        try:
            dfd = _open_dir(directory)
        except (ConfigError, DiskError) as exc:
            log.warning("shared CPU tier: cannot reopen %s to remove %s: %s", directory, fname, exc)
            dfd = -1
        try:
            if dfd >= 0:
                with _DirLock(dfd, directory):
                    if self._claimed:
                        self._write_u32(_PID_AT, 0)
                    try:  # nobody else holds it (attaches run under the same dir lock): we are the last
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        _unlink_if_same(fname, dfd, self._ino, self.info.path)
                    except BlockingIOError:
                        pass
                    finally:
                        os.close(fd)
            else:
                os.close(fd)
        finally:
            if dfd >= 0:
                os.close(dfd)
            self.rows = np.zeros((0, self.info.row_bytes), dtype=np.uint8)
            mapping, self._map = self._map, None
            try:
                mapping.close()
            except BufferError:  # views still exported: unmapped when the last one goes
                pass

    # -- header -----------------------------------------------------------------------------
    def _write_header(self) -> None:
        i = self.info
        head = _HEADER.pack(MAGIC, VERSION, i.world_size, i.shard_bytes, i.num_slots, 0, 0)
        self._map[: len(head)] = head
        self._write_u32(_READY_AT, READY)  # last: an attacher that sees it sees the whole header

    def _claim(self) -> None:
        """Record this process as the segment's scheduler, unless another live one is (called under the dir lock)."""
        pid = struct.unpack_from("<I", self._map, _PID_AT)[0]
        if pid and pid != os.getpid() and _alive(pid):
            raise ConfigError(f"{SETTING}: {self.info.path} is in use by a live engine (scheduler pid {pid}); "
                              f"give each engine its own engine id, or stop the other one")  # fmt: skip
        self._write_u32(_PID_AT, os.getpid())
        self._claimed = True

    def _write_u32(self, at: int, value: int) -> None:
        struct.pack_into("<I", self._map, at, value)

    def __repr__(self) -> str:
        i = self.info
        return f"SharedSegment({i.path!r}, world_size={i.world_size}, shard_bytes={i.shard_bytes}, slots={i.num_slots})"


def reclaim_dead(directory: str) -> list[str]:
    """Unlink our segments in ``directory`` that no live process holds; returns their names.

    Only regular files named like ours, owned by our euid, mode 0600 and with one link are touched;
    a segment is never read, only removed: its engine died and its rows are not trusted.
    """
    dfd = _open_dir(directory)
    try:
        with _DirLock(dfd, directory):
            return _reclaim(dfd, directory)
    finally:
        os.close(dfd)


def _reclaim(dfd: int, directory: str) -> list[str]:
    """``reclaim_dead`` with the directory lock held (a creator is never caught before its LOCK_SH)."""
    reclaimed: list[str] = []
    for entry in os.scandir(dfd):
        if not (entry.name.startswith(PREFIX) and entry.name.endswith(SUFFIX)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or \
                    stat.S_IMODE(st.st_mode) != 0o600:  # fmt: skip
                continue
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live engine (or one of its workers) holds it
        try:
            if os.fstat(fd).st_ino == os.stat(entry.name, dir_fd=dfd, follow_symlinks=False).st_ino:
                os.unlink(entry.name, dir_fd=dfd)
                reclaimed.append(entry.name)
                log.warning("shared CPU tier: reclaimed %s left by an engine that is gone (its blocks "
                            "are not read)", os.path.join(directory, entry.name))  # fmt: skip
        except OSError:
            pass
        finally:
            os.close(fd)
    return reclaimed


# -- helpers --------------------------------------------------------------------------------
def _open_dir(directory: str) -> int:
    """The segment directory as an fd: a sticky shared tmpfs (/dev/shm) or a directory only we can write."""
    try:
        fd = os.open(directory, DIR_FLAGS)
    except OSError as e:
        raise ConfigError(f"{SETTING}: cannot open {directory!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        # In a world-writable dir only the sticky bit stops others from removing or renaming our file.
        if not (st.st_mode & stat.S_ISVTX and stat.S_ISDIR(st.st_mode)):
            check_trusted_dir(st, directory, what="shared CPU tier directory", setting=SETTING)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _DirLock:
    """``tkv-<euid>.lock`` in the directory, held LOCK_EX while scanning and creating."""

    def __init__(self, dfd: int, directory: str) -> None:
        name = f"{PREFIX}{os.geteuid()}.lock"
        self._fd = open_regular(name, os.O_RDWR | os.O_CREAT, dir_fd=dfd, path=os.path.join(directory, name),
                                what="shared CPU tier lock file", setting=SETTING)  # fmt: skip

    def __enter__(self) -> _DirLock:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def _check_private(st: os.stat_result, path: str) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise DiskError(errno.EPERM, f"{_WHAT} has mode {mode:04o}: readable or writable by others, and it holds "
                        f"users' prompts as KV. Remove it (tiered_kv creates it 0600) or point {SETTING} "
                        f"elsewhere", path)  # fmt: skip


def _open_file(fname: str, dfd: int, path: str, flags: int) -> int:
    return open_regular(fname, flags, dir_fd=dfd, path=path, what=_WHAT, setting=SETTING)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _preflight(dfd: int, directory: str, nbytes: int) -> None:
    st = os.statvfs(dfd)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ConfigError(
            f"tiers.cpu.capacity: the shared CPU tier needs {nbytes} bytes ({format_size(nbytes)}) in {directory} "
            f"but only {free} bytes ({format_size(free)}) are free there. Give the container more shared memory "
            f"(docker run --shm-size=...), set {SETTING} to a larger tmpfs or hugetlbfs mount, or lower "
            f"tiers.cpu.capacity"
        )


def _reserve(fd: int, info: SegmentInfo, directory: str) -> None:
    """Size the file and take its pages now: a tmpfs that fills later would SIGBUS a copy instead."""
    try:
        os.posix_fallocate(fd, 0, info.file_bytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # e.g. a hugetlbfs: size it, pages come at mmap
            os.ftruncate(fd, info.file_bytes)
            return
        raise ConfigError(f"{SETTING}: reserving {info.file_bytes} bytes ({format_size(info.file_bytes)}) in "
                          f"{directory} failed ({e.strerror}); give the container more shared memory "
                          f"(--shm-size) or point {SETTING} elsewhere") from None  # fmt: skip


def _check_header(raw: bytes, info: SegmentInfo) -> None:
    if len(raw) < _HEADER.size:
        raise LayoutError(f"{info.path}: header is {len(raw)} bytes, not a tiered_kv shared segment")
    magic, version, world, shard, slots, _pid, ready = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise LayoutError(f"{info.path} is not a tiered_kv shared segment of version {VERSION} "
                          f"(magic {magic!r}, version {version})")  # fmt: skip
    if ready != READY:
        raise LayoutError(f"{info.path}: its creator did not finish writing the header")
    if shard != info.shard_bytes:
        raise LayoutError(f"{info.path}: this process's KV tensors give {info.shard_bytes} bytes per block per TP "
                          f"rank but the segment was made for {shard} (by the scheduler or another rank); both "
                          f"must derive bytes per block from the same logical sizes")  # fmt: skip
    for what, got, want in (("world_size", world, info.world_size), ("num_slots", slots, info.num_slots)):
        if got != want:
            raise LayoutError(f"{info.path}: the segment was made for {what} {got} but this process expects "
                              f"{want}; the scheduler and every rank must size it from the same config")  # fmt: skip


def _unlink_if_same(fname: str, dfd: int, ino: int, path: str) -> None:
    try:
        if os.stat(fname, dir_fd=dfd, follow_symlinks=False).st_ino == ino:
            os.unlink(fname, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("shared CPU tier: could not remove %s: %s", path, e)
