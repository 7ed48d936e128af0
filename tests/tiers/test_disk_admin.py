"""disk ls / gc: list namespaces with their fields; remove only chosen namespace dirs that are ours."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import pytest
from disk_helpers import put

from tiered_kv.errors import DiskError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk.admin import is_stale, list_namespaces, remove_namespaces

A = DiskNamespace("model-a", "float16", "layout-1", 3096, 32)
B = DiskNamespace("model-b", "bfloat16", "layout-2", 3096, 16)


async def fill(root, ns: DiskNamespace, n: int) -> None:
    async with DiskStore(root, ns, 8) as store:
        keys = [hashlib.sha256(f"{ns.model_id}{i}".encode()).digest()[: ns.key_bytes] for i in range(n)]
        assert (await put(store, range(n), keys)).all()


async def test_ls_shows_namespaces_with_fields(tmp_path):
    await fill(tmp_path, A, 3)
    await fill(tmp_path, B, 5)
    (tmp_path / "unrelated-dir").mkdir()
    (tmp_path / "ns-0123456789abcdef0123").mkdir()  # right shape, no namespace.json: not listed
    infos = {i.dirname: i for i in list_namespaces(tmp_path)}
    assert set(infos) == {A.dirname(), B.dirname()}
    a, b = infos[A.dirname()], infos[B.dirname()]
    assert (a.model_id, a.dtype, a.layout_digest, a.bytes_per_block, a.blocks, a.key_bytes) == (
        "model-a", "float16", "layout-1", 3096, 3, 32)
    assert (b.model_id, b.dtype, b.blocks, b.key_bytes) == ("model-b", "bfloat16", 5, 16)
    assert a.size_bytes >= 3 * 4096 and b.size_bytes > a.size_bytes
    assert not is_stale(a, A) and is_stale(b, A) and is_stale(a, None)


async def test_gc_removes_only_chosen(tmp_path):
    await fill(tmp_path, A, 2)
    await fill(tmp_path, B, 2)
    stale = [i.dirname for i in list_namespaces(tmp_path) if is_stale(i, A)]
    assert stale == [B.dirname()]
    assert remove_namespaces(tmp_path, stale) == stale
    assert not (tmp_path / B.dirname()).exists()
    assert [i.dirname for i in list_namespaces(tmp_path)] == [A.dirname()]
    async with DiskStore(tmp_path, A, 8) as store:  # the kept one is intact
        assert len(store.recovered) == 2


async def test_gc_refuses_dirs_that_are_not_ours(tmp_path):
    await fill(tmp_path, A, 1)
    victim = tmp_path / "ns-0123456789abcdef0123"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    with pytest.raises(DiskError, match="namespace.json"):
        remove_namespaces(tmp_path, [A.dirname(), victim.name])
    assert (victim / "precious.txt").exists() and (tmp_path / A.dirname()).exists()  # nothing removed
    for bad in ("..", "../x", "unrelated", "/etc"):
        with pytest.raises(DiskError):
            remove_namespaces(tmp_path, [bad])


async def test_gc_refuses_copied_json_foreign_files_symlinks_and_open_stores(tmp_path):
    await fill(tmp_path, A, 1)
    ours = tmp_path / A.dirname()
    # a namespace.json copied into a dir whose name it does not hash to
    fake = tmp_path / "ns-ffffffffffffffffffff"
    fake.mkdir()
    shutil.copy(ours / "namespace.json", fake / "namespace.json")
    with pytest.raises(DiskError, match="namespace.json"):
        remove_namespaces(tmp_path, [fake.name])
    # our dir, but someone put their own file in it
    (ours / "notes.txt").write_text("x")
    with pytest.raises(DiskError, match="did not create") as ei:
        remove_namespaces(tmp_path, [A.dirname()])
    assert ei.value.errno == errno.ENOTEMPTY and ours.exists()
    (ours / "notes.txt").unlink()
    # a symlink named like a namespace is never followed
    other = tmp_path / "elsewhere"
    shutil.copytree(ours, other / A.dirname())
    linkroot = tmp_path / "linkroot"
    linkroot.mkdir()
    (linkroot / A.dirname()).symlink_to(other / A.dirname())
    assert list_namespaces(linkroot) == []
    with pytest.raises(DiskError):
        remove_namespaces(linkroot, [A.dirname()])
    assert (other / A.dirname() / "namespace.json").exists()
    # an open store holds the lock
    async with DiskStore(tmp_path, A, 8):
        with pytest.raises(DiskError) as ei:
            remove_namespaces(tmp_path, [A.dirname()])
        assert ei.value.errno == errno.EBUSY
    assert remove_namespaces(tmp_path, [A.dirname()]) == [A.dirname()]


async def test_ls_ignores_json_of_other_formats(tmp_path):
    await fill(tmp_path, A, 1)
    nsfile = tmp_path / A.dirname() / "namespace.json"
    doc = json.loads(nsfile.read_text())
    nsfile.write_text(json.dumps({**doc, "format_version": 999}))
    assert list_namespaces(tmp_path) == []
    with pytest.raises(DiskError):
        remove_namespaces(tmp_path, [A.dirname()])
    assert os.path.isdir(tmp_path / A.dirname())
