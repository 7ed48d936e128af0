"""The shared-memory CPU tier: layout, header checks, permissions, preflight, liveness after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from slab_blocks import read_blocks, write_blocks

from tiered_kv.errors import ConfigError, DiskError, LayoutError
from tiered_kv.tiers.segment_geometry import round_up
from tiered_kv.tiers.shared_cpu import (
    _READY_AT,
    PAGE,
    SegmentInfo,
    SharedSegment,
    reclaim_dead,
    segment_name,
)
from tiered_kv.tiers.shared_slabs import SharedCpuSlabs

HERE = Path(__file__).parent


def info(tmp_path: Path, name: str = "eng0", **kw) -> SegmentInfo:
    args = {"world_size": 2, "shard_bytes": 1024, "num_slots": 4} | kw
    return SegmentInfo.for_engine(str(tmp_path), name, **args)


def test_each_rank_has_a_contiguous_page_aligned_sub_slab(tmp_path):
    sched = SharedSegment.open(info(tmp_path), scheduler=True)
    path = Path(sched.info.path)
    assert path.name == segment_name("eng0")
    assert (path.stat().st_mode & 0o777) == 0o600
    assert sched.info.header_bytes == PAGE  # one page of the running system (issue 27 defect C)
    assert path.stat().st_size == PAGE + 2 * round_up(4 * 1024, PAGE)
    w0 = SharedSegment.open(info(tmp_path))
    w1 = SharedSegment.open(info(tmp_path))
    w0.shard(0)[2] = 7
    w1.shard(1)[2] = 9
    for seg in (w0, w1):
        for rank in range(2):
            sub = seg.shard(rank)
            assert sub.flags.c_contiguous and sub.shape == (4, 1024) and sub.ctypes.data % PAGE == 0
    assert w1.shard(1).ctypes.data - w1.shard(0).ctypes.data == round_up(4 * 1024, PAGE)
    assert sched.blocks.shape == (4, 2, 1024)
    assert (sched.blocks[2, 0] == 7).all() and (sched.blocks[2, 1] == 9).all()
    assert not sched.blocks[[0, 1, 3]].any()
    slabs = SharedCpuSlabs(sched, [512, 512, 512, 512])
    assert read_blocks(slabs, [2]).tobytes() == bytes([7] * 1024 + [9] * 1024)  # rank 0's bytes first
    assert int(slabs.regions[3][2, 0]) == 9 and slabs.offsets == [0, 512, 1024, 1536]
    write_blocks(slabs, [1], (np.arange(2048) % 251).astype(np.uint8).reshape(1, 2048))
    assert (w1.shard(1)[1] == np.arange(1024, 2048) % 251).all()
    slabs.release()  # the scheduler leaves first: the workers still map it
    assert path.exists()
    w0.close()
    assert path.exists()
    w1.close()  # the last one out removes it, and the liveness lock file
    assert not path.exists() and not list(tmp_path.glob("tkv-eng0*"))
    slabs.release()  # idempotent


def test_regions_that_straddle_two_ranks_are_refused(tmp_path):
    seg = SharedSegment.open(info(tmp_path))
    with pytest.raises(LayoutError, match="straddles TP ranks 0 and 1"):
        SharedCpuSlabs(seg, [768, 768, 512])
    with pytest.raises(LayoutError, match="gives 1024 bytes per block but the segment's blocks are 2 x 1024"):
        SharedCpuSlabs(seg, [1024])
    seg.close()


def test_the_geometry_follows_the_page_of_the_system_it_runs_on():
    """A 64 KiB page (aarch64, GH200): the header and every sub-slab start on one, so no rank's pin
    chunk starts inside a page another rank (or the header) registered."""
    big = SegmentInfo.for_engine("/x", "e", world_size=4, shard_bytes=3000, num_slots=100, page=65536)
    assert big.header_bytes == 65536
    assert [big.rank_offset(r) for r in range(4)] == [65536 * (1 + 5 * r) for r in range(4)]  # 300,000 B -> 5 pages
    assert big.file_bytes == 65536 * 21
    with pytest.raises(LayoutError, match="outside the segment's TP group of world_size 4"):
        big.rank_offset(4)
    with pytest.raises(ConfigError, match="page must be a power of two"):
        SegmentInfo.for_engine("/x", "e", world_size=1, shard_bytes=1, num_slots=1, page=12288)


def test_whoever_opens_second_checks_the_geometry_naming_both_numbers(tmp_path):
    first = SharedSegment.open(info(tmp_path))  # e.g. rank 0's register_kv_caches
    with pytest.raises(LayoutError, match=r"give 1536 bytes per block per TP rank but the segment was made for 1024"):
        SharedSegment.open(info(tmp_path, shard_bytes=1536))
    with pytest.raises(LayoutError, match="made for num_slots 4 but this process expects 5"):
        SharedSegment.open(info(tmp_path, num_slots=5))
    with pytest.raises(LayoutError, match="made for world_size 2 but this process expects 4"):
        SharedSegment.open(info(tmp_path, world_size=4, shard_bytes=1024, num_slots=4))
    with pytest.raises(LayoutError, match="world_size 2"):
        first.shard(2)
    first.close()
    with pytest.raises(LayoutError, match="does not exist"):
        SharedSegment.open(info(tmp_path), create=False)


def test_a_half_written_header_never_attaches(tmp_path):
    seg = SharedSegment.open(info(tmp_path))
    seg._write_u32(_READY_AT, 0)  # as if its creator died before the last word of the header
    with pytest.raises(LayoutError, match="did not finish writing the header"):
        SharedSegment.open(info(tmp_path))
    seg.close()


def test_wider_mode_is_refused(tmp_path):
    seg = SharedSegment.open(info(tmp_path))
    os.chmod(seg.info.path, 0o640)
    with pytest.raises(DiskError, match="mode 0640"):
        SharedSegment.open(info(tmp_path))
    seg.close()
    planted = tmp_path / segment_name("eng0")
    planted.write_bytes(b"x" * 100)
    os.chmod(planted, 0o644)
    with pytest.raises(DiskError, match="mode 0644"):
        SharedSegment.open(info(tmp_path))
    assert planted.read_bytes() == b"x" * 100  # refused, never reclaimed or rewritten


def test_foreign_owner_is_refused_and_never_reclaimed(tmp_path):
    planted = tmp_path / segment_name("eng0")
    planted.write_bytes(b"y" * 100)
    os.chmod(planted, 0o600)
    os.chown(planted, 12345, 12345)
    assert reclaim_dead(str(tmp_path)) == []
    with pytest.raises(DiskError, match="owned by uid 12345"):
        SharedSegment.open(info(tmp_path))
    assert planted.read_bytes() == b"y" * 100


def test_group_writable_directory_without_sticky_bit_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(DiskError, match="writable by group or others"):
        SharedSegment.open(info(d))
    os.chmod(d, 0o1777)  # like /dev/shm: others cannot remove or rename our file
    SharedSegment.open(info(d)).close()


def test_preflight_names_capacity_free_bytes_and_the_remedy(tmp_path):
    st = os.statvfs(tmp_path)
    slots = st.f_bavail * st.f_frsize // (2 << 20) + 8
    with pytest.raises(ConfigError) as err:
        SharedSegment.open(info(tmp_path, shard_bytes=1 << 20, num_slots=slots))
    msg = str(err.value)
    assert f"needs {info(tmp_path, shard_bytes=1 << 20, num_slots=slots).file_bytes} bytes" in msg
    assert "bytes" in msg.split("only ")[1] and "--shm-size" in msg and "tiers.cpu.shared_path" in msg
    assert not list(tmp_path.glob("*.kv"))


def test_a_second_live_scheduler_on_one_segment_is_refused(tmp_path):
    seg = SharedSegment.open(info(tmp_path), scheduler=True)
    with pytest.raises(ConfigError, match=f"in use by a live engine \\(scheduler pid {os.getpid()}\\)"):
        _open_as_other_process(info(tmp_path))
    seg.close()


def _open_as_other_process(i: SegmentInfo) -> None:
    """A scheduler claim from a different pid (a child process, so the claim check sees another live pid)."""
    code = ("import sys; from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment as S; "
            f"S.open(SegmentInfo({i.path!r}, {i.world_size}, {i.shard_bytes}, {i.num_slots}), scheduler=True)")
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    if out.returncode:
        raise ConfigError(out.stderr.strip().splitlines()[-1])


def test_a_killed_engines_segment_is_reclaimed_and_never_read(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    proc = subprocess.Popen([sys.executable, str(HERE / "shm_holder_proc.py"), str(tmp_path), "eng0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    mine = info(tmp_path, world_size=2, shard_bytes=4096, num_slots=8)
    try:
        path = proc.stdout.readline().strip()
        assert path == mine.path and Path(path).exists()
        with pytest.raises(ConfigError, match="in use by a live engine"):  # alive: never taken over
            SharedSegment.open(mine, scheduler=True)
        assert reclaim_dead(str(tmp_path)) == []
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert Path(path).exists()  # nobody cleaned up: the engine died
    other = SharedSegment.open(info(tmp_path, "eng1"))  # any engine's start reclaims it, whatever its name
    assert not Path(path).exists()
    other.close()
    seg = SharedSegment.open(mine, scheduler=True)
    assert not seg.blocks.any()  # a fresh segment: the dead engine's 0xAB rows are gone
    seg.close()
    assert not Path(path).exists()
