"""Which filesystem a path lives on, and the check that a shared segment there can be page-locked.

On an H200 (issue 38) ``cudaHostRegister`` refused a MAP_SHARED mapping of a file on ext4 (CUDA error 1)
and accepted anonymous memory and a file on ``/dev/shm``; the error blamed RLIMIT_MEMLOCK. A segment to
pin must live on tmpfs or hugetlbfs, so that is checked before anything is mapped or registered.
``os.statvfs`` does not report the filesystem type: ``statfs(2)`` (through ctypes) does, and
/proc/self/mountinfo names it for the message.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from ..errors import ConfigError

TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
PINNABLE = {TMPFS_MAGIC: "tmpfs", HUGETLBFS_MAGIC: "hugetlbfs"}


def fs_magic(path: str) -> int | None:
    """``f_type`` of ``statfs(path)``, or None where statfs is not available (not Linux)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux: f_type first
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def fs_name(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (mountinfo's longest matching mount point)."""
    real = os.path.realpath(path)
    best, name = -1, "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) > best:
                    best, name = len(point), right.split()[0]
    except OSError:
        pass
    return name


def check_pinnable(path: str, *, setting: str = "tiers.cpu.shared_path", why: str = "pinning is on",
                   other: str = "") -> None:  # fmt: skip
    """ConfigError unless ``path`` is on tmpfs or hugetlbfs (a path that does not exist yet is left to
    whoever opens it). ``other``: another way out, for the message."""
    try:
        magic = fs_magic(path)
    except FileNotFoundError:
        return
    if magic is None or magic in PINNABLE:
        return
    raise ConfigError(
        f"{setting} is {path!r}, on a {fs_name(path)} filesystem (statfs f_type {magic:#x}), but {why}: CUDA "
        f"page-locks a shared mapping only on tmpfs or hugetlbfs (cudaHostRegister refuses a file on a disk "
        f"filesystem). Set {setting} to a tmpfs such as /dev/shm{other}"
    )
