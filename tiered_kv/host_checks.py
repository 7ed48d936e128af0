"""What this machine can give a config: memory, disk space, and paths the OS accepts.

A capacity typo (99999TiB) or a path the kernel refuses (a NUL byte, a 300-byte
name) should fail when the config is loaded, naming the key and both numbers,
not when a replay or a cache allocates it minutes later.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError
from .sizes import format_size

if TYPE_CHECKING:
    from .config import Config

# Bookkeeping RAM per slot of any tier once full: index arrays, policy links, the key and its dict entry.
SLOT_OVERHEAD_BYTES = 256
NAME_MAX, PATH_MAX = 255, 4096


def check_host_resources(cfg: Config, bytes_per_block: int) -> None:
    """Refuse tiers this machine cannot hold (a typo like 99999TiB), unless allow_overcommit says so.

    Memory: the CPU tier plus the bookkeeping of every slot, against MemAvailable.
    Disk: every record the tier can write (records are padded to 4 KiB), against the
    free space of the path plus what its namespaces already hold.
    """
    cpu, disk = cfg.tiers.cpu, cfg.tiers.disk
    slots = cpu.capacity // bytes_per_block + (disk.capacity // bytes_per_block if disk.enabled else 0)
    available = mem_available()
    if not cpu.allow_overcommit and available is not None:
        need = cpu.capacity + slots * SLOT_OVERHEAD_BYTES
        if need > available:
            raise ConfigError(
                f"tiers.cpu.capacity: {format_size(cpu.capacity)} plus the index of {slots} slots "
                f"({format_size(slots * SLOT_OVERHEAD_BYTES)}) needs {need} bytes, more than the "
                f"{available} bytes ({format_size(available)}) of MemAvailable; lower it or set "
                f"tiers.cpu.allow_overcommit: true"
            )
    if disk.enabled and not disk.allow_overcommit:
        from .tiers.disk.format import HEADER_SIZE  # lazily: the tiers import this module

        record = -(-(HEADER_SIZE + bytes_per_block) // 4096) * 4096
        need = disk.capacity // bytes_per_block * record
        free = _disk_room(Path(disk.path))
        if free is not None and need > free:
            raise ConfigError(
                f"tiers.disk.capacity: {format_size(disk.capacity)} needs {need} bytes on disk "
                f"({format_size(need)} in 4 KiB-aligned records), more than the {free} bytes "
                f"({format_size(free)}) free at {disk.path!r}; lower it or set tiers.disk.allow_overcommit: true"
            )


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


def _disk_room(path: Path) -> int | None:
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
