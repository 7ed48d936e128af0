"""Who may write the disk tier's directory: owner and mode checks, links and special files, clean failure.

Whoever can write the directory can serve KV blocks (checksums catch accidents, not edits), so a cache
directory or namespace directory of another user, or one that group or others can write, is refused;
and no file inside is followed through a symlink or hard link or opened when it is a FIFO.
The ownership cases need root (chown); they run as root here and skip elsewhere.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import stat
import threading

import pytest
from disk_helpers import get, payload, put

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore

BPB = 4196
NS = DiskNamespace("trust-model", "float16", "trust-layout", BPB, 32)
FILES = ["namespace.json", "blocks.dat", "journal.tkv", "lock"]
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"trust%d" % i).digest()


async def make_namespace(root, n: int = 2) -> str:
    async with DiskStore(root, NS, 8) as store:
        assert (await put(store, range(n), [key_of(i) for i in range(n)])).all()
        return store.path


async def open_fails(root) -> DiskError:
    with pytest.raises(DiskError) as ei:
        await DiskStore(root, NS, 8).open()
    return ei.value


async def reopen_ok(root, n: int = 2) -> None:
    async with DiskStore(root, NS, 8) as store:
        assert sorted(r.slot for r in store.recovered) == list(range(n))
        keys = [key_of(i) for i in range(n)]
        assert await get(store, range(n), keys) == [payload(k, BPB) for k in keys]


@needs_root
@pytest.mark.parametrize("which", ["root", "namespace"])
async def test_directory_of_another_user_is_refused(tmp_path, which):
    root = tmp_path / "cache"
    nsdir = await make_namespace(root)
    target = str(root) if which == "root" else nsdir
    os.chown(target, NOBODY, NOBODY)
    err = await open_fails(root)
    msg = str(err)
    assert err.errno == errno.EPERM and target in msg and f"uid {NOBODY}" in msg and "chown" in msg
    os.chown(target, os.geteuid(), os.getegid())
    await reopen_ok(root)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
@pytest.mark.parametrize("which", ["root", "namespace"])
async def test_group_or_world_writable_directory_is_refused_and_left_alone(tmp_path, which, mode):
    root = tmp_path / "cache"
    nsdir = await make_namespace(root)
    target = str(root) if which == "root" else nsdir
    os.chmod(target, mode)
    err = await open_fails(root)
    msg = str(err)
    assert err.errno == errno.EPERM and target in msg and f"{mode:04o}" in msg and "chmod go-w" in msg
    assert stat.S_IMODE(os.stat(target).st_mode) == mode  # never chmod'ed behind the user's back
    os.chmod(target, 0o700)
    await reopen_ok(root)


async def test_own_directories_0700_and_0755_are_accepted(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    nsdir = await make_namespace(root)
    assert stat.S_IMODE(os.stat(nsdir).st_mode) == 0o700  # what we create
    os.chmod(nsdir, 0o755)
    await reopen_ok(root)


@pytest.mark.parametrize("name", FILES)
async def test_hard_linked_file_is_refused_and_outside_file_untouched(tmp_path, name):
    root = tmp_path / "cache"
    path = os.path.join(await make_namespace(root), name)
    outside = tmp_path / "outside"
    with open(path, "rb") as f:  # a copy of the real file, so only the link count gives it away
        outside.write_bytes(f.read())
    before = outside.read_bytes()
    os.unlink(path)
    os.link(outside, path)
    err = await open_fails(root)
    assert err.errno == errno.EMLINK and path in str(err) and "hard links" in str(err)
    assert outside.read_bytes() == before and os.stat(outside).st_nlink == 2
    os.unlink(path)
    os.rename(outside, path)  # one link again: accepted, blocks intact
    await reopen_ok(root)


def _unblock(fifo: str) -> None:
    """If an open is stuck reading the FIFO, give it a writer so the test can end."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("name", FILES)
async def test_fifo_in_place_of_a_file_is_refused_without_hanging(tmp_path, name):
    root = tmp_path / "cache"
    path = os.path.join(await make_namespace(root), name)
    saved = open(path, "rb").read()
    os.unlink(path)
    os.mkfifo(path, 0o600)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # An open stuck reading the FIFO cannot be cancelled (it waits for its executor job), so a timer
    # gives it a writer after 5 s: the test then fails on time instead of hanging.
    timer = loop.call_later(5, _unblock, path)
    try:
        with pytest.raises(DiskError) as ei:
            await DiskStore(root, NS, 8).open()
    finally:
        timer.cancel()
    assert loop.time() - t0 < 5, "the open waited on the FIFO"
    err = ei.value
    assert path in str(err) and "regular file" in str(err)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(saved)
    os.chmod(path, 0o600)
    await reopen_ok(root)


@pytest.mark.parametrize("name", FILES)
async def test_symlinked_file_is_refused_and_target_untouched(tmp_path, name):
    root = tmp_path / "cache"
    path = os.path.join(await make_namespace(root), name)
    outside = tmp_path / "outside"
    os.rename(path, outside)
    before = outside.read_bytes()
    os.symlink(outside, path)
    err = await open_fails(root)
    assert err.errno == errno.ELOOP and path in str(err) and "symlink" in str(err)
    assert outside.read_bytes() == before
    os.unlink(path)
    os.rename(outside, path)
    await reopen_ok(root)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _disk_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tkv-disk")]


@pytest.mark.parametrize("plant", ["fifo", "hard_link"])
async def test_failed_open_releases_fds_threads_and_lock(tmp_path, plant):
    """The journal is opened after the flock is taken: a failure there must give everything back."""
    root = tmp_path / "cache"
    jpath = os.path.join(await make_namespace(root), "journal.tkv")
    saved = tmp_path / "journal.saved"
    os.rename(jpath, saved)
    if plant == "fifo":
        os.mkfifo(jpath, 0o600)
    else:
        os.link(saved, jpath)
    fds, threads = _open_fds(), _disk_threads()
    for _ in range(3):  # the same process retries: never EBUSY from a lock we still hold
        err = await open_fails(root)
        assert err.errno != errno.EBUSY and jpath in str(err)
        assert _open_fds() == fds and _disk_threads() == threads
    os.unlink(jpath)
    os.rename(saved, jpath)
    await reopen_ok(root)
    assert _open_fds() == fds and _disk_threads() == threads
