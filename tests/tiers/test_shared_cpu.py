"""The shared-memory CPU tier: layout, header checks, permissions, preflight, liveness after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_kv.errors import ConfigError, DiskError, LayoutError
from tiered_kv.tiers.shared_cpu import HEADER_BYTES, SharedCpuSlabs, SharedSegment, reclaim_dead, segment_name

HERE = Path(__file__).parent


def make(tmp_path: Path, name: str = "eng0", **kw) -> SharedSegment:
    args = {"world_size": 2, "shard_bytes": 1024, "num_slots": 4, "layout_digest": "abc123"} | kw
    return SharedSegment.create(str(tmp_path), name, **args)


def test_rows_are_slot_major_and_rank_interleaved(tmp_path):
    seg = make(tmp_path)
    path = Path(seg.info.path)
    assert path.name == segment_name("eng0")
    assert (path.stat().st_mode & 0o777) == 0o600
    assert path.stat().st_size == HEADER_BYTES + 4 * 2 * 1024
    w0 = SharedSegment.attach(seg.info, rank=0, shard_bytes=1024)
    w1 = SharedSegment.attach(seg.info, rank=1, shard_bytes=1024)
    w0.shard(0)[2] = 7
    w1.shard(1)[2] = 9
    assert seg.rows.shape == (4, 2048)
    assert (seg.rows[2, :1024] == 7).all() and (seg.rows[2, 1024:] == 9).all()
    assert not seg.rows[[0, 1, 3]].any()
    slabs = SharedCpuSlabs(seg, [512, 512, 512, 512])
    assert bytes(slabs.rows(2, 1)) == bytes([7] * 1024 + [9] * 1024)
    assert int(slabs.regions[3][2, 0]) == 9
    w0.close()
    w1.close()
    slabs.release()
    assert not path.exists()
    slabs.release()  # idempotent


def test_attach_refuses_other_bytes_per_block_naming_both(tmp_path):
    seg = make(tmp_path)
    with pytest.raises(LayoutError, match=r"1536 bytes per block per rank but the scheduler planned 1024"):
        SharedSegment.attach(seg.info, rank=1, shard_bytes=1536)
    with pytest.raises(LayoutError, match="world_size 2"):
        SharedSegment.attach(seg.info, rank=2, shard_bytes=1024)
    seg.close()


def test_attach_checks_the_header_not_just_the_message(tmp_path):
    """A worker told the right numbers still refuses a segment whose header says otherwise."""
    seg = make(tmp_path)
    other = make(tmp_path, "eng1", shard_bytes=2048)
    lie = type(seg.info)(other.info.path, 2, 1024, 4, "abc123")
    with pytest.raises(LayoutError, match=r"1024 bytes per block per rank but the scheduler planned 2048"):
        SharedSegment.attach(lie, rank=0, shard_bytes=1024)
    lie = type(seg.info)(seg.info.path, 2, 1024, 4, "other")
    with pytest.raises(LayoutError, match="layout digest 'abc123'"):
        SharedSegment.attach(lie, rank=0, shard_bytes=1024)
    seg.close()
    other.close()


def test_wider_mode_is_refused_by_create_and_attach(tmp_path):
    seg = make(tmp_path)
    info = seg.info
    os.chmod(info.path, 0o640)
    with pytest.raises(DiskError, match="mode 0640"):
        SharedSegment.attach(info, rank=0, shard_bytes=1024)
    seg.close()
    planted = tmp_path / segment_name("eng0")
    planted.write_bytes(b"x" * 100)
    os.chmod(planted, 0o644)
    with pytest.raises(DiskError, match="mode 0644"):
        make(tmp_path)
    assert planted.read_bytes() == b"x" * 100  # refused, never reclaimed or rewritten


def test_foreign_owner_is_refused_and_never_reclaimed(tmp_path):
    planted = tmp_path / segment_name("eng0")
    planted.write_bytes(b"y" * 100)
    os.chmod(planted, 0o600)
    os.chown(planted, 12345, 12345)
    assert reclaim_dead(str(tmp_path)) == []
    with pytest.raises(DiskError, match="owned by uid 12345"):
        make(tmp_path)
    assert planted.exists()
    info = type(make(tmp_path, "eng1").info)(str(planted), 2, 1024, 4, "abc123")
    with pytest.raises(DiskError, match="owned by uid 12345"):
        SharedSegment.attach(info, rank=0, shard_bytes=1024)


def test_group_writable_directory_without_sticky_bit_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(DiskError, match="writable by group or others"):
        make(d)
    os.chmod(d, 0o1777)  # like /dev/shm: others cannot remove or rename our file
    make(d).close()


def test_preflight_names_capacity_free_bytes_and_the_remedy(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    slots = free // (2 * (1 << 20)) + 8
    with pytest.raises(ConfigError) as err:
        make(tmp_path, shard_bytes=1 << 20, num_slots=slots)
    msg = str(err.value)
    assert f"needs {HEADER_BYTES + slots * (2 << 20)} bytes" in msg
    assert "bytes" in msg.split("only ")[1] and "--shm-size" in msg and "tiers.cpu.shared_path" in msg
    assert not list(tmp_path.glob("*.kv"))


def test_a_live_segment_of_the_same_name_is_refused(tmp_path):
    seg = make(tmp_path)
    with pytest.raises(ConfigError, match="in use by a live engine"):
        make(tmp_path)
    assert reclaim_dead(str(tmp_path)) == []
    seg.close()


def test_a_killed_engines_segment_is_reclaimed_and_never_read(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    proc = subprocess.Popen([sys.executable, str(HERE / "shm_holder_proc.py"), str(tmp_path), "eng0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    try:
        path = proc.stdout.readline().strip()
        assert Path(path).exists()
        with pytest.raises(ConfigError, match="in use by a live engine"):  # alive: never taken over
            make(tmp_path, world_size=2, shard_bytes=4096, num_slots=8)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert Path(path).exists()  # nobody cleaned up: the engine died
    other = make(tmp_path, "eng1")  # any engine's start reclaims it, whatever its own name
    assert not Path(path).exists()
    other.close()
    seg = make(tmp_path, world_size=2, shard_bytes=4096, num_slots=8)
    assert seg.info.path == path
    assert not seg.rows.any()  # a fresh segment: the dead engine's 0xAB rows are gone
    seg.close()
    assert not Path(path).exists()
