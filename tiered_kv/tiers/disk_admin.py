"""Namespace directories of the disk tier: create/verify one safely, list them, remove them.

Used by DiskStore (``prepare_namespace_dir``) and by ``tiered-kv disk ls|gc PATH``. Deletion is
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
import time
from dataclasses import dataclass

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk_format import (
    DATA_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    NS_FILE,
    DiskNamespace,
    namespace_json,
    open_private,
    parse_namespace_json,
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
