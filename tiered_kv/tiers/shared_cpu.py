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
# magic, version, world_size, shard_bytes, num_slots, layout digest (ascii, padded), ready
_HEADER = struct.Struct("<8sIIQQ32sI")
_WHAT = "shared CPU tier segment"


@dataclass(frozen=True)
class SegmentInfo:
    """What a worker needs to attach (the scheduler sends it in the connector metadata)."""

    path: str
    world_size: int
    shard_bytes: int
    num_slots: int
    layout_digest: str = ""

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
    """A mapped segment. Build with ``create`` (the scheduler) or ``attach`` (a worker)."""

    def __init__(self, info: SegmentInfo, fd: int, *, owner: bool) -> None:
        self.info = info
        self._fd = fd
        self._owner = owner
        self._ino = os.fstat(fd).st_ino
        self._map: mmap.mmap | None = mmap.mmap(fd, info.file_bytes, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        self.rows = np.frombuffer(self._map, dtype=np.uint8, count=info.num_slots * info.row_bytes,
                                  offset=HEADER_BYTES).reshape(info.num_slots, info.row_bytes)  # fmt: skip

    # -- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, directory: str, name: str, *, world_size: int, shard_bytes: int, num_slots: int,
               layout_digest: str = "") -> SharedSegment:  # fmt: skip
        """Create this engine's segment in ``directory`` (reclaiming dead ones first); ConfigError if short of room."""
        for what, value, low in (("world_size", world_size, 1), ("shard_bytes", shard_bytes, 1),
                                 ("num_slots", num_slots, 1)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"shared CPU tier: {what} must be an int >= {low}, got {value!r}")
        if len(layout_digest.encode()) > 32:
            raise ConfigError(f"shared CPU tier: layout digest {layout_digest!r} is longer than 32 bytes")
        fname = segment_name(name)
        info = SegmentInfo(os.path.join(directory, fname), world_size, shard_bytes, num_slots, layout_digest)
        dfd = _open_dir(directory)
        try:
            with _DirLock(dfd, directory):
                reclaim_dead(directory, dir_fd=dfd)
                _refuse_existing(fname, dfd, info.path)
                _preflight(dfd, directory, info.file_bytes)
                fd = open_regular(fname, os.O_RDWR | os.O_CREAT | os.O_EXCL, dir_fd=dfd, path=info.path,
                                  what=_WHAT, setting=SETTING)  # fmt: skip
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # alive from here on
                    os.fchmod(fd, 0o600)  # O_CREAT's mode went through the umask
                    _reserve(fd, info, directory)
                    seg = cls(info, fd, owner=True)
                    seg._write_header()
                except BaseException:
                    os.close(fd)
                    os.unlink(fname, dir_fd=dfd)
                    raise
        finally:
            os.close(dfd)
        return seg

    @classmethod
    def attach(cls, info: SegmentInfo, *, rank: int, shard_bytes: int) -> SharedSegment:
        """Map an existing segment as TP rank ``rank``; LayoutError when its numbers differ from ours."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < info.world_size:
            raise LayoutError(f"rank {rank!r} is outside the segment's TP group of world_size {info.world_size}")
        if shard_bytes != info.shard_bytes:
            raise LayoutError(_shard_mismatch(rank, shard_bytes, info.shard_bytes, info.path))
        directory, fname = os.path.split(info.path)
        dfd = _open_dir(directory)
        try:
            try:
                fd = open_regular(fname, os.O_RDWR, dir_fd=dfd, path=info.path, what=_WHAT, setting=SETTING)
            except FileNotFoundError:
                raise LayoutError(f"the shared CPU tier segment {info.path} does not exist (has its engine "
                                  f"exited?)") from None  # fmt: skip
        finally:
            os.close(dfd)
        try:
            _check_private(os.fstat(fd), info.path)
            fcntl.flock(fd, fcntl.LOCK_SH)
            _check_header(os.pread(fd, _HEADER.size, 0), info, rank, shard_bytes)
            if os.fstat(fd).st_size < info.file_bytes:
                raise LayoutError(f"{info.path} holds {os.fstat(fd).st_size} bytes, less than the "
                                  f"{info.file_bytes} its header describes")  # fmt: skip
            return cls(info, fd, owner=False)
        except BaseException:
            os.close(fd)
            raise

    # -- views ----------------------------------------------------------------------------
    def shard(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s bytes of every slot: ``uint8[num_slots, shard_bytes]``, rows strided by the row size."""
        if not 0 <= rank < self.info.world_size:
            raise LayoutError(f"rank {rank} is outside [0, {self.info.world_size})")
        b = self.info.shard_bytes
        return self.rows[:, rank * b : (rank + 1) * b]

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Creator: unlink, then unlock and unmap; attacher: unlock and unmap. Idempotent.

        The mapping goes once no view of it is left (numpy or torch views keep it alive); until then
        the mapping's own duplicate of the fd keeps our LOCK_SH too, so a reclaim never removes it.
        """
        if self._fd < 0:
            return
        if self._owner:
            _unlink_if_same(self.info.path, self._ino)
        fd, self._fd = self._fd, -1
        os.close(fd)  # releases our LOCK_SH
        self.rows = np.zeros((0, self.info.row_bytes), dtype=np.uint8)
        mapping, self._map = self._map, None
        try:
            mapping.close()
        except BufferError:  # views still exported: the mapping is unmapped when the last one goes
            pass

    def _write_header(self) -> None:
        i = self.info
        head = _HEADER.pack(MAGIC, VERSION, i.world_size, i.shard_bytes, i.num_slots,
                            i.layout_digest.encode(), 0)  # fmt: skip
        self._map[: len(head)] = head
        # ready last: an attacher that reads it set sees the whole header
        self._map[_HEADER.size - 4 : _HEADER.size] = struct.pack("<I", READY)

    def __repr__(self) -> str:
        i = self.info
        return f"SharedSegment({i.path!r}, world_size={i.world_size}, shard_bytes={i.shard_bytes}, slots={i.num_slots})"


class SharedCpuSlabs:
    """The segment's rows as the CPU tier's slab: a drop-in for ``tiers.cpu.CpuSlabs`` (disk, remote, restage).

    ``regions[r]`` are column views of the group layout's regions over whole rows (rank-major).
    The segment is the caller's: ``release`` drops the views, ``close`` also closes the segment.
    """

    pinned = False  # the scheduler's rows are only touched by its own disk and remote I/O

    def __init__(self, segment: SharedSegment, region_block_bytes: tuple[int, ...] | list[int]) -> None:
        import torch

        info = segment.info
        if sum(region_block_bytes) != info.row_bytes:
            raise LayoutError(f"the layout gives {sum(region_block_bytes)} bytes per block but the segment's rows "
                              f"are {info.world_size} x {info.shard_bytes} = {info.row_bytes} bytes")  # fmt: skip
        self.segment = segment
        self.num_slots = info.num_slots
        self.bytes_per_block = info.row_bytes
        self.nbytes = info.num_slots * info.row_bytes
        self.slab_np = segment.rows
        self.slab = torch.from_numpy(segment.rows)
        self.offsets: list[int] = []
        self.regions: list = []
        offset = 0
        for block_bytes in region_block_bytes:
            self.offsets.append(offset)
            self.regions.append(self.slab[:, offset : offset + block_bytes])
            offset += block_bytes

    def rows(self, first: int, count: int) -> memoryview:
        """Slots ``first .. first + count - 1`` as one writable buffer (for vectored I/O)."""
        return memoryview(self.slab_np[first : first + count]).cast("B")

    def release(self) -> None:
        """Drop the views and close the segment (the creator removes its file). Idempotent."""
        self.regions = []
        self.slab = self.slab_np = None
        self.segment.close()


def reclaim_dead(directory: str, *, dir_fd: int | None = None) -> list[str]:
    """Unlink our segments in ``directory`` that no live process holds; returns their names.

    Only regular files named like ours, owned by our euid, mode 0600 and with one link are touched;
    a segment is never read, only removed: its engine died and its rows are not trusted.
    """
    own = dir_fd is None
    dfd = _open_dir(directory) if own else dir_fd
    reclaimed: list[str] = []
    try:
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
    finally:
        if own:
            os.close(dfd)
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


def _refuse_existing(fname: str, dfd: int, path: str) -> None:
    """A segment of our name that survived the reclaim is foreign, too open, or alive: refuse it."""
    try:
        fd = open_regular(fname, os.O_RDONLY, dir_fd=dfd, path=path, what=_WHAT, setting=SETTING)
    except FileNotFoundError:
        return
    try:
        _check_private(os.fstat(fd), path)
        raise ConfigError(f"{SETTING}: {path} is in use by a live engine instance of the same name; give each "
                          f"engine its own name (vLLM's engine_id) or stop the other one")  # fmt: skip
    finally:
        os.close(fd)


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


def _shard_mismatch(rank: int, ours: int, theirs: int, path: str) -> str:
    return (f"TP rank {rank}: this worker's KV tensors give {ours} bytes per block per rank but the scheduler "
            f"planned {theirs} (segment {path}); the worker and the scheduler must derive bytes per block from "
            f"the same logical sizes")  # fmt: skip


def _check_header(raw: bytes, info: SegmentInfo, rank: int, shard_bytes: int) -> None:
    if len(raw) < _HEADER.size:
        raise LayoutError(f"{info.path}: header is {len(raw)} bytes, not a tiered_kv shared segment")
    magic, version, world, shard, slots, digest, ready = _HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise LayoutError(f"{info.path} is not a tiered_kv shared segment of version {VERSION} "
                          f"(magic {magic!r}, version {version})")  # fmt: skip
    if ready != READY:
        raise LayoutError(f"{info.path}: its creator has not finished writing the header")
    if shard != shard_bytes:
        raise LayoutError(_shard_mismatch(rank, shard_bytes, shard, info.path))
    digest = digest.rstrip(b"\0").decode("ascii", "replace")
    for what, got, want in (("world_size", world, info.world_size), ("num_slots", slots, info.num_slots),
                            ("layout digest", digest, info.layout_digest)):  # fmt: skip
        if got != want:
            raise LayoutError(f"{info.path}: the segment's header says {what} {got!r} but this worker was told "
                              f"{want!r}")  # fmt: skip


def _unlink_if_same(path: str, ino: int) -> None:
    try:
        if os.stat(path, follow_symlinks=False).st_ino == ino:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("shared CPU tier: could not remove %s: %s", path, e)
