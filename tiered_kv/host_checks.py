"""What this machine can give a config: memory, disk space, and paths the OS accepts.

A capacity typo (99999TiB) or a path the kernel refuses (a NUL byte, a 300-byte
name) should fail when the config is loaded, naming the key and both numbers,
not when a replay or a cache allocates it minutes later.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Bookkeeping RAM per slot of any tier once full: index arrays, policy links, the key and its dict entry.
SLOT_OVERHEAD_BYTES = 256
NAME_MAX, PATH_MAX = 255, 4096


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def disk_room(path: Path) -> int | None:
    """Free bytes where ``path`` lives, plus what its namespaces already hold (reused on restart)."""
    probe = path
    try:
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
    except OSError:
        return None
    held = 0
    if probe == path:
        try:
            for ns in os.scandir(path):
                if ns.name.startswith("ns-") and ns.is_dir(follow_symlinks=False):
                    held += sum(f.stat(follow_symlinks=False).st_blocks * 512 for f in os.scandir(ns.path)
                                if f.is_file(follow_symlinks=False))
        except OSError:
            pass
    return free + held


def expand_path(path: str) -> str:
    """``~`` and ``$VAR`` / ``${VAR}`` expanded; ValueError for a path the OS cannot take.

    A ``$`` left after expansion is an unset variable, refused rather than created as a
    literal ``$HOME`` directory.
    """
    if "\0" in path:
        raise ValueError(f"{path[:64]!r} contains a NUL byte")
    expanded = os.path.expanduser(os.path.expandvars(path))
    if "$" in expanded:
        raise ValueError(f"{path[:200]!r} names an unset environment variable (expanded: {expanded[:200]!r})")
    raw = os.fsencode(os.path.abspath(expanded))
    if len(raw) >= PATH_MAX:
        raise ValueError(f"{expanded[:64]!r}... is {len(raw)} bytes long, over PATH_MAX ({PATH_MAX - 1})")
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            raise ValueError(
                f"{expanded[:64]!r}... has a component of {len(part)} bytes, over NAME_MAX ({NAME_MAX})"
            )
    return expanded


def dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot hold the disk tier, or None. A missing dir is fine if creatable."""
    probe = path
    try:
        while not probe.exists():
            if probe.parent == probe:
                return "has no existing parent directory"
            probe = probe.parent
    except OSError as exc:  # e.g. a parent we may not search
        return f"cannot be checked: {exc.strerror or exc}"
    if not probe.is_dir():
        return f"is not a directory ({probe} is a file)" if probe == path else f"cannot be created: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"is not writable ({probe})"
    return None
