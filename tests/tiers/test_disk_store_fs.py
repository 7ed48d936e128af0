"""DiskStore against its file system: permissions, symlinks, a root it cannot use, a second opener, O_DIRECT,
ENOSPC on a real tmpfs mount (where the container allows it) and /dev/full.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess

import pytest
from disk_helpers import get, put
from store_helpers import NS, key_of, payload, read_bytes, write

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk import DiskStore


def mount_tmpfs(path, opts: str) -> None:
    os.makedirs(path, exist_ok=True)
    # mode=0700: a tmpfs root is 1777 by default, which the disk tier refuses (world-writable)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{opts},mode=0700", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here (container?): {r.stderr.decode().strip()}")


def umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)



async def test_permissions_0700_0600(tmp_path):
    root = tmp_path / "fresh" / "root"
    async with DiskStore(root, NS, 4) as store:
        await write(store, 0, key_of(0))
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
        names = sorted(os.listdir(store.path))
        assert names == ["blocks.dat", "journal.tkv", "lock", "namespace.json"]
        for name in names:
            assert stat.S_IMODE(os.stat(os.path.join(store.path, name)).st_mode) == 0o600, name


async def test_symlinked_root_or_namespace_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(DiskError) as ei:
        await DiskStore(link, NS, 4).open()
    assert ei.value.errno == errno.ELOOP and str(link) in str(ei.value)
    async with DiskStore(link, NS, 4, allow_symlink=True) as store:
        await write(store, 0, key_of(0))
    # a namespace dir swapped for a symlink is refused too
    root2 = tmp_path / "root2"
    root2.mkdir()
    (root2 / NS.dirname()).symlink_to(real / NS.dirname())
    with pytest.raises(DiskError, match="symlink"):
        await DiskStore(root2, NS, 4).open()


async def test_root_not_a_directory(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(DiskError) as ei:
        await DiskStore(f, NS, 4).open()
    assert ei.value.errno == errno.ENOTDIR and str(f) in str(ei.value)


async def test_root_not_writable(tmp_path):
    """Unprivileged: a 0500 dir. As root (which bypasses modes): a read-only tmpfs mount, else skip."""
    ro = tmp_path / "ro"
    if os.geteuid() != 0:
        ro.mkdir()
        ro.chmod(0o500)
    else:
        mount_tmpfs(ro, "ro,size=1m")
    try:
        with pytest.raises(DiskError) as ei:
            await DiskStore(ro, NS, 4).open()
        assert str(ro) in str(ei.value) and "writable" in str(ei.value)
    finally:
        umount(ro) if os.geteuid() == 0 else ro.chmod(0o700)


async def test_second_open_of_same_namespace_refused(tmp_path):
    async with DiskStore(tmp_path, NS, 4):
        with pytest.raises(DiskError) as ei:
            await DiskStore(tmp_path, NS, 4).open()
        assert ei.value.errno == errno.EBUSY


@pytest.mark.parametrize("fsync", [False, True])
async def test_o_direct_on_tmp_path(tmp_path, caplog, fsync):
    caplog.set_level(logging.WARNING, "tiered_kv.disk")
    async with DiskStore(tmp_path, NS, 8, o_direct=True, fsync=fsync) as store:
        assert isinstance(store.o_direct_active, bool)
        if not store.o_direct_active:
            assert store.o_direct_reason and store.o_direct_reason in caplog.text
        for i in range(8):
            await write(store, i, key_of(i))
        for i in range(8):
            assert await read_bytes(store, i, key_of(i)) == payload(key_of(i))
    async with DiskStore(tmp_path, NS, 8) as store:  # buffered reopen reads what O_DIRECT wrote
        assert await read_bytes(store, 7, key_of(7)) == payload(key_of(7))


class _NoDirectFS(DiskStore):
    """A file system that rejects O_DIRECT, injected at the open(2) boundary (tmpfs accepts it since 6.6)."""

    def _open_direct(self, path: str) -> int:
        raise OSError(errno.EINVAL, "Invalid argument", path)


async def test_o_direct_fallback_logs_reason(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "tiered_kv.disk")
    async with _NoDirectFS(tmp_path, NS, 4, o_direct=True) as store:
        assert store.o_direct_active is False
        assert "Invalid argument" in store.o_direct_reason
        assert "falling back to buffered" in caplog.text
        await write(store, 1, key_of(1))
        assert await read_bytes(store, 1, key_of(1)) == payload(key_of(1))


async def test_enospc_real_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (skipped where mount is not allowed): writes run until the kernel says ENOSPC."""
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "size=1m")
    try:
        async with DiskStore(mnt, NS, 400) as store:
            written: list[int] = []
            with pytest.raises(DiskError) as ei:
                for i in range(0, 400, 4):  # batches of 4 consecutive slots: one run each
                    batch = list(range(i, i + 4))
                    await put(store, batch, [key_of(j) for j in batch])
                    written += batch
            assert ei.value.errno == errno.ENOSPC and 10 < len(written) < 400
            assert store.write_errors == 1 and not store._writing.any()
            assert await get(store, written, [key_of(i) for i in written]) == [payload(key_of(i)) for i in written]
        async with DiskStore(mnt, NS, 400) as store:  # the failed batch committed nothing
            assert sorted(r.slot for r in store.recovered) == written
    finally:
        umount(mnt)


@pytest.mark.parametrize("target", ["data", "journal"])
async def test_enospc_injected_via_dev_full(tmp_path, target):
    """Injected at the syscall boundary: /dev/full is dup2'ed over the data or journal fd for one write."""
    async with DiskStore(tmp_path, NS, 8) as store:
        for i in range(4):
            await write(store, i, key_of(i))
        fd = store._dfd if target == "data" else store._journal.fd
        saved, full = os.dup(fd), os.open("/dev/full", os.O_RDWR)
        os.dup2(full, fd)
        try:
            with pytest.raises(DiskError) as ei:
                await write(store, 2, key_of(42))  # overwrite: slot 2 loses its old block either way
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            os.close(full)
        assert ei.value.errno == errno.ENOSPC
        for i in (0, 1, 3):
            assert await read_bytes(store, i, key_of(i)) == payload(key_of(i))
        await write(store, 5, key_of(5))  # the store goes on working once space is back
    async with DiskStore(tmp_path, NS, 8) as store:
        got = {r.slot: r.key for r in store.recovered}
        assert got[5] == key_of(5) and {0, 1, 3} <= set(got) and got.get(2) in (None, key_of(2), key_of(42))
        for r in store.recovered:
            assert await read_bytes(store, r.slot, r.key) == payload(r.key)
        assert store.corrupt_blocks == 0

