"""The shared CPU segment's files: directory trust, the per-user directory lock, checks, reclaiming.

Three kinds of file live in the segment directory (``tiers.cpu.shared_path``), all ours, 0600, one link:

* ``tkv-<engine>.kv``: the segment. Its name exists only while the engine's processes attach; once every
  one has mapped it, the name is unlinked and the mappings alone keep the memory (the kernel frees it when
  the last process exits, ``kill -9`` included).
* ``tkv-<engine>.live``: a lock file that holds no data. Every process that maps the segment holds
  ``LOCK_SH`` on it for as long as it does, so "is the engine alive?" survives the segment's name going
  away: a second engine with the same engine id is refused, a dead engine's leftovers are reclaimed.
* ``tkv-<euid>.lock``: the directory lock, held ``LOCK_EX`` while scanning, creating, attaching and
  removing, so nobody is ever seen between creating a file and locking it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat

from ..errors import ConfigError, DiskError
from ..sizes import format_size
from .disk.files import DIR_FLAGS, check_trusted_dir, open_regular
from .segment_geometry import PREFIX, SUFFIX

log = logging.getLogger("tiered_kv.tiers.shared_cpu")

SETTING = "tiers.cpu.shared_path"
LIVE_SUFFIX = ".live"
WHAT = "shared CPU tier segment"


def live_name(segment_file: str) -> str:
    """The liveness lock file beside segment file ``tkv-<engine>.kv``."""
    return segment_file[: -len(SUFFIX)] + LIVE_SUFFIX


def open_dir(directory: str) -> int:
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


class DirLock:
    """``tkv-<euid>.lock`` in the directory, held LOCK_EX while scanning, creating and removing."""

    def __init__(self, dfd: int, directory: str) -> None:
        name = f"{PREFIX}{os.geteuid()}.lock"
        self._fd = open_regular(name, os.O_RDWR | os.O_CREAT, dir_fd=dfd, path=os.path.join(directory, name),
                                what="shared CPU tier lock file", setting=SETTING)  # fmt: skip

    def __enter__(self) -> DirLock:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


def open_file(fname: str, dfd: int, path: str, flags: int, what: str = WHAT) -> int:
    return open_regular(fname, flags, dir_fd=dfd, path=path, what=what, setting=SETTING)


def check_private(st: os.stat_result, path: str) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise DiskError(errno.EPERM, f"{WHAT} has mode {mode:04o}: readable or writable by others, and it holds "
                        f"users' prompts as KV. Remove it (tiered_kv creates it 0600) or point {SETTING} "
                        f"elsewhere", path)  # fmt: skip


def held_by_others(fname: str, dfd: int) -> bool:
    """Whether some process holds a lock on ``fname`` (probed on an fd of our own, released at once).

    Called under the directory lock: every lock on a live file is taken under it, so the answer holds
    until we release the directory lock.
    """
    try:
        fd = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def preflight(dfd: int, directory: str, nbytes: int) -> None:
    st = os.statvfs(dfd)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ConfigError(
            f"tiers.cpu.capacity: the shared CPU tier needs {nbytes} bytes ({format_size(nbytes)}) in {directory} "
            f"but only {free} bytes ({format_size(free)}) are free there. Give the container more shared memory "
            f"(docker run --shm-size=...), set {SETTING} to a larger tmpfs or hugetlbfs mount, or lower "
            f"tiers.cpu.capacity"
        )


def reserve(fd: int, nbytes: int, directory: str) -> None:
    """Size the file and take its pages now: a tmpfs that fills later would SIGBUS a copy instead."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # e.g. a hugetlbfs: size it, pages come at mmap
            os.ftruncate(fd, nbytes)
            return
        raise ConfigError(f"{SETTING}: reserving {nbytes} bytes ({format_size(nbytes)}) in {directory} failed "
                          f"({e.strerror}); give the container more shared memory (--shm-size) or point "
                          f"{SETTING} elsewhere") from None  # fmt: skip


def unlink_if_same(fname: str, dfd: int, ino: int | None, path: str) -> bool:
    """Unlink ``fname`` if it is still the inode ``ino`` (any inode when None); True if it did."""
    try:
        if ino is None or os.stat(fname, dir_fd=dfd, follow_symlinks=False).st_ino == ino:
            os.unlink(fname, dir_fd=dfd)
            return True
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("shared CPU tier: could not remove %s: %s", path, e)
    return False


def _ours(dfd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1 and \
        stat.S_IMODE(st.st_mode) == 0o600  # fmt: skip


def reclaim(dfd: int, directory: str) -> list[str]:
    """Unlink what engines that are gone left (call with the directory lock held); returns the names.

    A ``.live`` file nobody locks is a dead engine's: it goes, with its segment if the name is still
    there. A segment without a ``.live`` file (one made by a tiered_kv before the lock files) goes when
    nobody locks the segment itself. Only regular files named like ours, owned by our euid, mode 0600,
    with one link are touched, and a segment is never read: its rows are not trusted.
    """
    reclaimed: list[str] = []
    names = {e.name for e in os.scandir(dfd) if e.name.startswith(PREFIX)}
    for name in sorted(names):
        if name.endswith(LIVE_SUFFIX) and _ours(dfd, name) and not held_by_others(name, dfd):
            seg = name[: -len(LIVE_SUFFIX)] + SUFFIX
            if seg in names and _ours(dfd, seg) and unlink_if_same(seg, dfd, None, seg):
                reclaimed.append(seg)
                log.warning("shared CPU tier: reclaimed %s left by an engine that is gone (its blocks are not "
                            "read)", os.path.join(directory, seg))  # fmt: skip
            unlink_if_same(name, dfd, None, name)
            reclaimed.append(name)
        elif name.endswith(SUFFIX) and live_name(name) not in names and _ours(dfd, name) \
                and not held_by_others(name, dfd):  # fmt: skip
            if unlink_if_same(name, dfd, None, name):
                reclaimed.append(name)
    return reclaimed
