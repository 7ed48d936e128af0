"""File-system primitives of the disk tier: trusted directories, single-link regular files, full writes.

Whoever can write the cache directory can serve KV blocks (checksums catch accidents, not edits), so:

* a directory we did not just create must be owned by our euid and not group- or world-writable;
  it is opened once (``O_DIRECTORY | O_NOFOLLOW``), checked with ``fstat`` on that fd, and every file
  inside is then opened relative to the fd, so nobody can swap the directory after the check;
* files are opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO planted at a name must not hang the open),
  then must be regular, ours, with exactly one link: a hard link to an outside file would have us
  overwrite it. Temp files are created ``O_EXCL`` after an unlink, never opened ``O_TRUNC`` in place.

Nothing is chmod'ed behind the user's back: a refusal says what to run.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat

from tiered_kv.errors import DiskError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC


def _owner_problem(st: os.stat_result, path: str, what: str, setting: str = "tiers.disk.path") -> DiskError | None:
    euid = os.geteuid()
    if st.st_uid != euid:
        return DiskError(errno.EPERM, f"{what} is owned by uid {st.st_uid}, not by this process (euid {euid}); "
                         f"whoever can write it can serve KV blocks. Fix: chown {euid} {path} "
                         f"(or point {setting} elsewhere)", path)
    return None


def check_trusted_dir(st: os.stat_result, path: str, *, what: str = "disk tier directory",
                      setting: str = "tiers.disk.path") -> None:  # fmt: skip
    """Refuse a directory another user could write into (owner, group/other write bits)."""
    if not stat.S_ISDIR(st.st_mode):
        raise DiskError(errno.ENOTDIR, f"{setting} is not a directory", path)
    if (err := _owner_problem(st, path, what, setting)) is not None:
        raise err
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise DiskError(errno.EPERM, f"{what} has mode {mode:04o}: writable by group or others, "
                        f"who could plant blocks in it. Fix: chmod go-w {path} (0700 is what tiered_kv "
                        f"creates)", path)


def open_trusted_dir(name: str, *, path: str, follow: bool, dir_fd: int | None = None, created: bool = False) -> int:
    """Open a directory (``name`` relative to ``dir_fd``) and check ownership and mode on the fd.

    ``created``: we just made it, so give it exactly 0700 (mkdir's mode went through the umask).
    """
    try:
        fd = os.open(name, DIR_FLAGS | (0 if follow else _NOFOLLOW), dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and os.path.islink(path)):
            raise DiskError(errno.ELOOP, "disk tier path is a symlink (set allow_symlink to use it)", path) from e
        if e.errno == errno.ENOTDIR:
            raise DiskError(errno.ENOTDIR, "disk tier path is not a directory", path) from e
        raise DiskError(e.errno, f"cannot open disk tier directory: {e.strerror}", path) from e
    try:
        if created:
            os.fchmod(fd, 0o700)
        check_trusted_dir(os.fstat(fd), path)
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
            raise DiskError(errno.EACCES, "disk tier directory is not writable", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(name: str, flags: int, *, dir_fd: int, path: str, mode: int = 0o600, strict: bool = True,
                 what: str = "disk tier file", setting: str = "tiers.disk.path") -> int:  # fmt: skip
    """Open ``name`` under ``dir_fd``: never through a symlink, never blocking on a FIFO; then require a
    regular file and, when ``strict`` (files we write or trust), one of ours with exactly one link.
    DiskError naming ``path`` otherwise."""
    try:
        fd = os.open(name, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DiskError(errno.ELOOP, f"is a symlink; tiered_kv never follows links to a {what}", path) from e
        if e.errno == errno.ENXIO:  # O_WRONLY | O_NONBLOCK on a FIFO without a reader
            raise DiskError(errno.EINVAL, "not a regular file (a FIFO or device)", path) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DiskError(errno.EINVAL, f"not a regular file (mode {st.st_mode:o}: a FIFO, device or "
                            f"directory); remove it", path)
        if strict and st.st_nlink != 1:
            raise DiskError(errno.EMLINK, f"has {st.st_nlink} hard links; writing it would change another "
                            f"file too. Remove it (tiered_kv recreates it)", path)
        if strict and (err := _owner_problem(st, path, what, setting)) is not None:
            raise err
        if _NONBLOCK:  # only there for the open itself; regular-file I/O ignores it, but say what we mean
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(name: str, *, dir_fd: int, path: str, create: bool = True) -> int:
    """Open (create, mode 0600) one of our files read-write."""
    fd = open_regular(name, os.O_RDWR | (os.O_CREAT if create else 0), dir_fd=dir_fd, path=path)
    if os.fstat(fd).st_mode & 0o077:  # inside a checked 0700 dir nobody else reaches it; tidy anyway
        os.fchmod(fd, 0o600)
    return fd


def create_fresh(name: str, *, dir_fd: int, path: str) -> int:
    """Create ``name`` anew (O_EXCL after unlinking whatever was there): for temp files, never O_TRUNC,
    which would truncate an outside file through a planted hard link before any check could run."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    return open_regular(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd, path=path)


def read_small(name: str, *, dir_fd: int, path: str, limit: int = 1 << 20, strict: bool = True) -> bytes:
    """Read a small regular file (namespace.json)."""
    fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd, path=path, strict=strict)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise DiskError(errno.EFBIG, f"{size} bytes, more than the {limit} expected", path)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def pwritev_all(fd: int, bufs: list, off: int, total: int) -> None:
    """Write ``total`` bytes of ``bufs`` (byte-format buffers) at ``off``: one pwritev unless the kernel
    writes short (a full disk, a signal); then go on from where it stopped, so the real errno (ENOSPC, EIO)
    surfaces as an OSError instead of a silent short write."""
    n = os.pwritev(fd, bufs, off)
    done, i = n, 0
    while done < total:
        while n >= len(bufs[i]):  # skip the buffers written whole, cut into the one written in part
            n -= len(bufs[i])
            i += 1
        rest = [memoryview(bufs[i])[n:], *bufs[i + 1 :]]
        n = os.pwritev(fd, rest, off + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwritev made no progress at offset {off + done}")
        bufs, i, done = rest, 0, done + n


def replace_file(dir_fd: int, dirpath: str, name: str, data: bytes, *, fsync: bool) -> int:
    """Atomically replace ``name`` with ``data`` (fresh temp file + os.replace); returns the open fd."""
    tmp = name + ".tmp"
    fd = create_fresh(tmp, dir_fd=dir_fd, path=os.path.join(dirpath, tmp))
    try:
        pwritev_all(fd, [data], 0, len(data))
        if fsync:
            os.fsync(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if fsync:
        os.fsync(dir_fd)
    return fd


def probe_aligned_read(fd: int, path: str, align: int = 4096) -> str:
    """"" when an aligned read works on ``fd`` (opened with O_DIRECT), else why not."""
    try:
        if (n := os.preadv(fd, [mmap.mmap(-1, align)], 0)) != align:
            raise OSError(errno.EINVAL, f"aligned probe read returned {n} bytes")
    except OSError as e:
        return f"O_DIRECT probe read failed on {path}: {e}"
    return ""
