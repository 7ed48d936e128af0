"""Namespace directories of the disk tier: open one safely, list them, remove them.

Used by DiskStore (``open_namespace_dir``) and by ``tiered-kv disk ls|gc PATH``. Opening checks that
the cache directory (when it already exists) and the namespace directory are ours and not group- or
world-writable (files.py). Deletion is deliberately narrow: only a directory named ``ns-<20 hex>``
that is not a symlink, that holds nothing but our files, that no DiskStore has open, and whose
namespace.json is either ours and hashes to that very name, or damaged (not JSON, or JSON of the wrong
shape: left by a crash or an accident). A namespace.json of another format or format version, or one of
ours copied under another name, is someone else's: never listed, never removed.
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

from .files import (
    DIR_FLAGS,
    open_private,
    open_regular,
    open_trusted_dir,
    read_small,
    replace_file,
)
from .format import (
    DATA_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    NS_FILE,
    DiskNamespace,
    ForeignNamespace,
    namespace_json,
    parse_namespace_json,
)
from .recovery import replay_journal_fd

log = logging.getLogger("tiered_kv.disk")
NS_DIR_RE = re.compile(r"^ns-[0-9a-f]{20}$")
# Everything a namespace dir may hold (temp files are left by a kill during an atomic replace).
OUR_FILES = frozenset({NS_FILE, NS_FILE + ".tmp", DATA_FILE, JOURNAL_FILE, JOURNAL_FILE + ".tmp", LOCK_FILE})
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class NamespaceInfo:
    dirname: str
    model_id: str
    dtype: str
    layout_digest: str
    bytes_per_block: int
    size_bytes: int  # allocated on disk (the data file is sparse)
    blocks: int  # committed blocks in the journal (-1: unknown)
    key_bytes: int = 32
    revision: str = ""
    shard: str = ""
    problem: str = ""  # set for a damaged namespace.json (the fields above are then empty): gc can remove it


def display_text(s: object) -> str:
    """``s`` safe to print on a terminal: control characters and escape sequences come out escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(s))


# ---- opening one (DiskStore) -----------------------------------------------------------------------
def _open_root(root: str, allow_symlink: bool) -> int:
    try:
        return open_trusted_dir(root, path=root, follow=allow_symlink)
    except DiskError as e:
        if e.errno != errno.ENOENT:
            raise
    try:
        os.makedirs(root, 0o700)
    except FileExistsError:  # created meanwhile by someone else: it gets the full check
        return open_trusted_dir(root, path=root, follow=allow_symlink)
    except OSError as e:
        raise DiskError(e.errno, f"cannot create disk tier directory: {e.strerror}", root) from e
    return open_trusted_dir(root, path=root, follow=allow_symlink, created=True)


def open_namespace_dir(root: str, ns: DiskNamespace, *, allow_symlink: bool) -> tuple[int, int]:
    """Create or verify root/ns-dir and its namespace.json; return (directory fd, fd holding its flock).

    Every file of the namespace is then opened relative to the directory fd.
    """
    root_fd = _open_root(root, allow_symlink)
    name = ns.dirname()
    path = os.path.join(root, name)
    dir_fd = lock_fd = -1
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
            created = True
        except FileExistsError:
            created = False
        dir_fd = open_trusted_dir(name, path=path, follow=allow_symlink, dir_fd=root_fd, created=created)
        lock_fd = open_private(LOCK_FILE, dir_fd=dir_fd, path=os.path.join(path, LOCK_FILE))
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskError(errno.EBUSY, "namespace dir is in use by another DiskStore", path) from None
        nsp = os.path.join(path, NS_FILE)
        try:
            raw = read_small(NS_FILE, dir_fd=dir_fd, path=nsp)
        except FileNotFoundError:
            os.close(replace_file(dir_fd, path, NS_FILE, namespace_json(ns, time.time()), fsync=True))
            return dir_fd, lock_fd
        try:
            on_disk, _ = parse_namespace_json(raw)
        except ValueError as e:
            raise DiskError(errno.EINVAL, f"unusable namespace.json ({e}); refusing to reuse it "
                            f"(`tiered-kv disk gc {root} {name}` removes it)", nsp) from None
        if on_disk != ns:
            diff = {k: (getattr(on_disk, k), getattr(ns, k)) for k in ns.__dataclass_fields__
                    if getattr(on_disk, k) != getattr(ns, k)}
            raise DiskError(errno.EEXIST, f"namespace.json disagrees with this store (on disk, wanted): {diff}", nsp)
    except BaseException:
        for fd in (lock_fd, dir_fd):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(root_fd)
    return dir_fd, lock_fd


# ---- ls / gc ---------------------------------------------------------------------------------------------
def _classify(dir_fd: int, root: str, name: str) -> tuple[DiskNamespace | None, str]:
    """(namespace, "") when ours; (None, why) when damaged; (None, "") when not ours to touch."""
    path = os.path.join(root, name, NS_FILE)
    try:
        raw = read_small(NS_FILE, dir_fd=dir_fd, path=path, strict=False)
    except FileNotFoundError:
        return None, ""
    except DiskError as e:  # a symlink, FIFO or device where namespace.json should be
        return None, f"namespace.json {e.strerror}"
    except OSError:
        return None, ""
    try:
        ns, _ = parse_namespace_json(raw)
    except ForeignNamespace:
        return None, ""
    except ValueError as e:
        return None, f"damaged namespace.json: {e}"
    return (ns, "") if ns.dirname() == name else (None, "")


def _open_ns_dir(root_fd: int, name: str) -> int | None:
    if not NS_DIR_RE.match(name):
        return None
    try:
        return os.open(name, DIR_FLAGS | _NOFOLLOW, dir_fd=root_fd)  # O_NOFOLLOW: a symlinked entry fails here
    except OSError:
        return None


def _count_blocks(dir_fd: int, ns: DiskNamespace) -> int:
    """Committed blocks, replayed as a DiskStore would (bounded memory; -1 when it cannot tell)."""
    try:
        st = os.stat(DATA_FILE, dir_fd=dir_fd, follow_symlinks=False)
        num_slots = st.st_size // ns.record_size if stat.S_ISREG(st.st_mode) else 0
        if num_slots >= 2**32:
            return -1
        jfd = open_regular(JOURNAL_FILE, os.O_RDONLY, dir_fd=dir_fd, path=JOURNAL_FILE, strict=False)
    except FileNotFoundError:
        return 0
    except OSError:
        return -1
    try:
        return int(replay_journal_fd(jfd, ns.key_bytes, num_slots).live.sum())
    finally:
        os.close(jfd)


def _size(dir_fd: int) -> int:
    total = 0
    for f in os.listdir(dir_fd):
        if f in OUR_FILES:
            try:
                total += os.stat(f, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return total


def list_namespaces(root: str | os.PathLike) -> list[NamespaceInfo]:
    """Namespaces under ``root`` (ours and damaged ones; anything else is ignored), sorted by dirname."""
    out = []
    root = os.fspath(root)
    root_fd = os.open(root, DIR_FLAGS)
    try:
        for name in sorted(os.listdir(root_fd)):
            if (dfd := _open_ns_dir(root_fd, name)) is None:
                continue
            try:
                ns, problem = _classify(dfd, root, name)
                if ns is not None:
                    out.append(NamespaceInfo(name, ns.model_id, ns.dtype, ns.layout_digest, ns.bytes_per_block,
                                             _size(dfd), _count_blocks(dfd, ns), ns.key_bytes, ns.revision,
                                             ns.shard))
                elif problem:
                    out.append(NamespaceInfo(name, "", "", "", 0, _size(dfd), -1, 0, problem=problem))
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)
    return out


def is_stale(info: NamespaceInfo, current: DiskNamespace | None) -> bool:
    """True unless ``info`` is the namespace in use now (with no current namespace, everything is stale)."""
    return current is None or info.dirname != current.dirname()


def _hold_for_removal(root_fd: int, root: str, name: str) -> tuple[int, int, list[str]]:
    """Check that ``name`` may be removed and take its flock; (dir fd, lock fd, files) or DiskError."""
    path = os.path.join(root, name)
    if (dfd := _open_ns_dir(root_fd, name)) is None:
        raise DiskError(errno.ENOENT, "not a namespace directory (or a symlink)", path)
    lfd = -1
    try:
        ns, problem = _classify(dfd, root, name)
        if ns is None and not problem:
            raise DiskError(errno.EINVAL, "no valid tiered_kv namespace.json here; refusing to delete", path)
        files = os.listdir(dfd)
        if foreign := sorted(set(files) - OUR_FILES):
            raise DiskError(errno.ENOTEMPTY, f"holds files tiered_kv did not create {foreign}; not deleting", path)
        if dirs := sorted(f for f in files if stat.S_ISDIR(os.stat(f, dir_fd=dfd, follow_symlinks=False).st_mode)):
            raise DiskError(errno.ENOTEMPTY, f"holds directories {dirs} where our files go; not deleting", path)
        lfd = open_regular(LOCK_FILE, os.O_RDWR | os.O_CREAT, dir_fd=dfd, path=os.path.join(path, LOCK_FILE),
                           strict=False)
        try:
            fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DiskError(errno.EBUSY, "namespace is open by a DiskStore; not deleting", path) from None
    except BaseException as e:
        for fd in (lfd, dfd):
            if fd >= 0:
                os.close(fd)
        if isinstance(e, OSError) and not isinstance(e, DiskError):
            raise DiskError(e.errno, f"cannot check it: {e.strerror}", path) from e
        raise
    return dfd, lfd, files


def remove_namespaces(root: str | os.PathLike, dirnames: list[str]) -> list[str]:
    """Delete the given namespace dirs (ours, or damaged ones); returns the names removed.

    Every name is checked before anything is deleted; DiskError (nothing removed) if one is not a
    namespace dir of ours, holds files we did not create, or is open by a DiskStore.
    """
    root = os.fspath(root)
    root_fd = os.open(root, DIR_FLAGS)
    held: list[tuple[str, int, int, list[str]]] = []  # name, dir fd, lock fd, files
    try:
        for name in dict.fromkeys(dirnames):
            held.append((name, *_hold_for_removal(root_fd, root, name)))
        for name, dfd, _lfd, files in held:
            # namespace.json last: a dir half-removed by a crash is still recognisable as ours.
            try:
                for f in sorted(set(files) | {LOCK_FILE}, key=lambda f: f == NS_FILE):
                    try:
                        os.unlink(f, dir_fd=dfd)
                    except FileNotFoundError:
                        pass
                os.rmdir(name, dir_fd=root_fd)
            except OSError as e:  # e.g. a file added meanwhile: say which dir, no traceback
                raise DiskError(e.errno, f"could not finish removing it: {e.strerror}",
                                os.path.join(root, name)) from e
        return [name for name, *_ in held]
    finally:
        for _name, dfd, lfd, _files in held:
            for fd in (lfd, dfd):
                if fd >= 0:
                    os.close(fd)
        os.close(root_fd)
