"""The CPU tier in shared memory: one segment per engine instance that the scheduler and every TP rank map.

The segment is rank-major (tiers/segment_geometry.py): a header page, then one contiguous, page-aligned
sub-slab per TP rank, ``uint8[num_slots, shard_bytes]``. A rank copies into and out of its own sub-slab
only, and page-locks only that; the scheduler's disk and remote tiers move a whole block as its ranks'
pieces in rank order (``blocks``: a ``[num_slots, storage_ranks, shard_bytes]`` view). KV that is the same
on ``kv_replicas`` consecutive ranks (MLA) has one sub-slab per replica set, which those ranks share.

The file holds users' prompts as KV, so it is created 0600 with O_EXCL, and one that exists with another
owner, a wider mode, a link or a second hard link is refused by the disk tier's rules (tiers/disk/files.py).

Lifetime (tiers/shared_files.py): every process that maps the segment holds LOCK_SH on the engine's
``.live`` lock file. Once every process has mapped the segment (the scheduler knows: the workers'
handshake reaches it after every rank attached), ``unlink_name`` removes the segment's name, so a normal
stop or a ``kill -9`` of everything leaves no memory in /dev/shm: the kernel frees it with the last
mapping. On a normal stop the last process out removes the ``.live`` file too; a killed engine's is
reclaimed by the next start. A second engine with the same engine id is refused while the first lives.

A header page lets every attacher check its own numbers (magic, version, world_size, shard_bytes,
num_slots, page, and kv_replicas in a word after the original header: 0 there means 1, so a segment
without replication has the header it always had); the ``ready`` word is written last, so a half-made
segment never attaches.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct

import numpy as np

from ..errors import ConfigError, DiskError, LayoutError
from . import shared_files as files
from .segment_geometry import PAGE, SegmentInfo, segment_name
from .shared_files import SETTING, live_name

__all__ = ["PAGE", "SETTING", "SegmentInfo", "SharedSegment", "reclaim_dead", "segment_name"]

log = logging.getLogger(__name__)

MAGIC, VERSION, READY = b"TKVSHM\x00\x01", 2, 0x52454459  # version 2: rank-major sub-slabs
# magic, version, world_size, shard_bytes, num_slots, page, scheduler pid, ready
_HEADER = struct.Struct("<8sIIQQQII")
_PID_AT, _READY_AT = _HEADER.size - 8, _HEADER.size - 4
_REPLICAS = struct.Struct("<I")  # kv_replicas at _HEADER.size (0: none, i.e. 1; written only when > 1)


class SharedSegment:
    """A mapped segment; build it with ``open`` (create or attach)."""

    def __init__(self, info: SegmentInfo, live_fd: int, map_fd: int) -> None:
        self.info = info
        # The flock lives on the .live file's fd: closing it ends our liveness claim even while numpy or
        # torch views keep the mapping (which holds a dup of ``map_fd``) alive.
        self._fd = live_fd
        self._ino = os.fstat(map_fd).st_ino
        self._claimed = False
        self._named = True
        self._map: mmap.mmap | None = mmap.mmap(map_fd, info.file_bytes, mmap.MAP_SHARED,
                                                mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        # A whole block as its stored ranks' pieces in rank order: [slot, stored rank, byte].
        self.blocks = np.ndarray((info.num_slots, info.storage_ranks, info.shard_bytes), np.uint8, self._map,
                                 info.header_bytes, (info.shard_bytes, info.rank_stride, 1))  # fmt: skip

    @classmethod
    def open(cls, info: SegmentInfo, *, scheduler: bool = False, create: bool = True) -> SharedSegment:
        """Attach to the segment, or create it (reclaiming dead ones first) when it does not exist.

        An existing one must be ours, 0600, one link, and hold exactly ``info``'s geometry (LayoutError
        naming both numbers otherwise). ``scheduler``: claim it for this process; a second live
        scheduler on one segment (two engines sharing an engine id) is a ConfigError.
        """
        directory, fname = os.path.split(info.path)
        lname = live_name(fname)
        dfd = files.open_dir(directory)
        try:
            with files.DirLock(dfd, directory):
                files.reclaim(dfd, directory)
                created = False
                try:
                    fd = files.open_file(fname, dfd, info.path, os.O_RDWR)
                except FileNotFoundError:
                    if files.held_by_others(lname, dfd):
                        raise ConfigError(f"{SETTING}: engine id {os.path.basename(info.path)!r} is in use by a live "
                                          f"engine whose processes have all attached its segment already; give "
                                          f"each engine its own engine id, or stop the other one") from None  # fmt: skip
                    if not create:
                        raise LayoutError(f"the shared CPU tier segment {info.path} does not exist (has its "
                                          f"engine exited?)") from None  # fmt: skip
                    files.preflight(dfd, directory, info.file_bytes)
                    fd = files.open_file(fname, dfd, info.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                    created = True
                return cls._map_locked(info, fd, dfd, fname, created, scheduler)
        finally:
            os.close(dfd)

    @classmethod
    def _map_locked(cls, info: SegmentInfo, fd: int, dfd: int, fname: str, created: bool,
                    scheduler: bool) -> SharedSegment:  # fmt: skip
        seg, live = None, -1
        directory = os.path.dirname(info.path)
        try:
            if created:
                os.fchmod(fd, 0o600)  # O_CREAT's mode went through the umask
            else:
                files.check_private(os.fstat(fd), info.path)
            live = files.open_file(live_name(fname), dfd, os.path.join(directory, live_name(fname)),
                                   os.O_RDWR | os.O_CREAT, what="shared CPU tier lock file")  # fmt: skip
            if os.fstat(live).st_mode & 0o077:
                os.fchmod(live, 0o600)
            fcntl.flock(live, fcntl.LOCK_SH)  # alive from here on
            if created:
                files.reserve(fd, info.file_bytes, directory)
            else:
                _check_header(os.pread(fd, _HEADER.size + _REPLICAS.size, 0), info)
                if os.fstat(fd).st_size < info.file_bytes:
                    raise LayoutError(f"{info.path} holds {os.fstat(fd).st_size} bytes, less than the "
                                      f"{info.file_bytes} its header describes")  # fmt: skip
            seg = cls(info, live, fd)
            if created:
                seg._write_header()
            if scheduler:
                seg._claim()
            return seg
        except BaseException:
            if seg is not None:
                seg._fd = -1
            if live >= 0:
                os.close(live)
            if created:
                os.unlink(fname, dir_fd=dfd)
                if not files.held_by_others(live_name(fname), dfd):
                    files.unlink_if_same(live_name(fname), dfd, None, info.path)
            raise
        finally:
            os.close(fd)  # the mapping holds its own reference to the file

    # -- views ----------------------------------------------------------------------------
    def shard(self, rank: int) -> np.ndarray:
        """TP rank ``rank``'s sub-slab: ``uint8[num_slots, shard_bytes]``, contiguous and page-aligned (the
        ranks of one replica set get the same one: ``SegmentInfo.storage_rank_of``)."""
        return self.sub_slab(self.info.storage_rank_of(rank))  # LayoutError for a rank outside the group

    def sub_slab(self, storage_rank: int) -> np.ndarray:
        """Stored rank ``storage_rank``'s sub-slab (0 .. storage_ranks - 1)."""
        self.info.sub_slab_offset(storage_rank)  # LayoutError outside the stored ranks
        return self.blocks[:, storage_rank, :]

    @property
    def closed(self) -> bool:
        return self._fd < 0

    @property
    def named(self) -> bool:
        """Whether the segment's name is still in the directory (see ``unlink_name``)."""
        return self._named

    def unlink_name(self) -> None:
        """Remove the segment's name once every process of the engine has mapped it. Idempotent.

        The mappings keep the memory until the last process unmaps or exits (``kill -9`` included), so
        nothing is left in the directory but the engine's empty ``.live`` lock file, which the last process
        out (or the next start, after a kill) removes.
        """
        if not self._named or self._fd < 0:
            return
        directory, fname = os.path.split(self.info.path)
        dfd = files.open_dir(directory)
        try:
            with files.DirLock(dfd, directory):
                files.unlink_if_same(fname, dfd, self._ino, self.info.path)
        finally:
            os.close(dfd)
        self._named = False

    def close(self) -> None:
        """Detach; the last process out removes the files. Idempotent.

        The mapping itself goes once no numpy or torch view of it is left.
        """
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        directory, fname = os.path.split(self.info.path)
        try:
            dfd = files.open_dir(directory)
        except (ConfigError, DiskError) as exc:
            log.warning("shared CPU tier: cannot reopen %s to remove %s: %s", directory, fname, exc)
            dfd = -1
        try:
            if dfd >= 0:
                with files.DirLock(dfd, directory):
                    if self._claimed and self._map is not None:
                        self._write_u32(_PID_AT, 0)
                    os.close(fd)  # our LOCK_SH goes; attaches run under the same dir lock
                    if not files.held_by_others(live_name(fname), dfd):  # we were the last
                        files.unlink_if_same(fname, dfd, self._ino, self.info.path)
                        files.unlink_if_same(live_name(fname), dfd, None, self.info.path)
            else:
                os.close(fd)
        finally:
            if dfd >= 0:
                os.close(dfd)
            self.blocks = np.zeros((0, self.info.storage_ranks, self.info.shard_bytes), dtype=np.uint8)
            mapping, self._map = self._map, None
            try:
                mapping.close()
            except BufferError:  # views still exported: unmapped when the last one goes
                pass

    # -- header -----------------------------------------------------------------------------
    def _write_header(self) -> None:
        i = self.info
        head = _HEADER.pack(MAGIC, VERSION, i.world_size, i.shard_bytes, i.num_slots, i.page, 0, 0)
        self._map[: len(head)] = head
        if i.kv_replicas > 1:  # only then: a segment without replication keeps its header byte for byte
            _REPLICAS.pack_into(self._map, _HEADER.size, i.kv_replicas)
        self._write_u32(_READY_AT, READY)  # last: an attacher that sees it sees the whole header

    def _claim(self) -> None:
        """Record this process as the segment's scheduler, unless another live one is (called under the dir lock)."""
        pid = struct.unpack_from("<I", self._map, _PID_AT)[0]
        if pid and pid != os.getpid() and files.alive(pid):
            raise ConfigError(f"{SETTING}: {self.info.path} is in use by a live engine (scheduler pid {pid}); "
                              f"give each engine its own engine id, or stop the other one")  # fmt: skip
        self._write_u32(_PID_AT, os.getpid())
        self._claimed = True

    def _write_u32(self, at: int, value: int) -> None:
        struct.pack_into("<I", self._map, at, value)

    def __repr__(self) -> str:
        i = self.info
        return (f"SharedSegment({i.path!r}, world_size={i.world_size}, kv_replicas={i.kv_replicas}, "
                f"shard_bytes={i.shard_bytes}, slots={i.num_slots})")  # fmt: skip


def reclaim_dead(directory: str) -> list[str]:
    """Unlink our files in ``directory`` that no live process holds; returns their names (shared_files.reclaim)."""
    dfd = files.open_dir(directory)
    try:
        with files.DirLock(dfd, directory):
            return files.reclaim(dfd, directory)
    finally:
        os.close(dfd)


def _check_header(raw: bytes, info: SegmentInfo) -> None:
    if len(raw) < _HEADER.size:
        raise LayoutError(f"{info.path}: header is {len(raw)} bytes, not a tiered_kv shared segment")
    magic, version, world, shard, slots, page, _pid, ready = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise LayoutError(f"{info.path} is not a tiered_kv shared segment of version {VERSION} "
                          f"(magic {magic!r}, version {version})")  # fmt: skip
    if ready != READY:
        raise LayoutError(f"{info.path}: its creator did not finish writing the header")
    if shard != info.shard_bytes:
        raise LayoutError(f"{info.path}: this process's KV tensors give {info.shard_bytes} bytes per block per TP "
                          f"rank but the segment was made for {shard} (by the scheduler or another rank); both "
                          f"must derive bytes per block from the same logical sizes")  # fmt: skip
    replicas = max(1, _REPLICAS.unpack_from(raw, _HEADER.size)[0]) if len(raw) >= _HEADER.size + 4 else 1
    if replicas != info.kv_replicas:
        raise LayoutError(f"{info.path}: the segment was made for kv_replicas {replicas} (TP ranks holding identical "
                          f"KV, stored once) but this process expects {info.kv_replicas}; the scheduler and every "
                          f"rank must read it from the same kv_cache_config (kv_tp_replicas)")  # fmt: skip
    for what, got, want in (("world_size", world, info.world_size), ("num_slots", slots, info.num_slots),
                            ("page", page, info.page)):  # fmt: skip
        if got != want:
            raise LayoutError(f"{info.path}: the segment was made for {what} {got} but this process expects "
                              f"{want}; the scheduler and every rank must size it from the same config")  # fmt: skip
