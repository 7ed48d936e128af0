"""The shared segment's lifetime (issue 25 item 8): once every process mapped it its name goes, so neither
a normal stop nor a SIGKILL of everything leaves memory in the directory; a second engine of the same id
is still refused while the first lives, and a restart after a kill works."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment, reclaim_dead

HERE = Path(__file__).parent


def info(tmp_path: Path, name: str = "eng0") -> SegmentInfo:
    return SegmentInfo.for_engine(str(tmp_path), name, world_size=2, shard_bytes=4096, num_slots=8)


def ours(tmp_path: Path, name: str = "eng0") -> list[str]:
    return sorted(p.name for p in tmp_path.glob(f"tkv-{name}.*"))


def _open_in_child(i: SegmentInfo) -> subprocess.CompletedProcess:
    code = ("from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment as S; "
            f"S.open(SegmentInfo({i.path!r}, {i.world_size}, {i.shard_bytes}, {i.num_slots}))")  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_once_every_process_mapped_it_the_name_is_gone_and_a_normal_stop_leaves_nothing(tmp_path):
    w0 = SharedSegment.open(info(tmp_path))  # the ranks' register_kv_caches
    w1 = SharedSegment.open(info(tmp_path))
    sched = SharedSegment.open(info(tmp_path), scheduler=True)
    assert ours(tmp_path) == ["tkv-eng0.kv", "tkv-eng0.live"]
    sched.unlink_name()  # the handshake reached the scheduler: every rank has it mapped
    sched.unlink_name()  # idempotent
    assert ours(tmp_path) == ["tkv-eng0.live"] and not sched.named
    w1.shard(1)[3] = 5  # still one memory for all of them
    assert (sched.blocks[3, 1] == 5).all() and (w0.blocks[3, 1] == 5).all()
    out = _open_in_child(info(tmp_path))  # a second engine with the same engine id, while this one lives
    assert out.returncode and "is in use by a live engine" in out.stderr
    assert ours(tmp_path) == ["tkv-eng0.live"]  # it created nothing
    for seg in (w0, sched, w1):
        seg.close()
    assert ours(tmp_path) == []  # the last one out removed the lock file too


def test_after_a_sigkill_of_everything_nothing_stays_and_a_restart_works(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]))
    proc = subprocess.Popen([sys.executable, str(HERE / "shm_holder_proc.py"), str(tmp_path), "eng0", "unlink"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)  # fmt: skip
    try:
        path = proc.stdout.readline().strip()
        assert path == info(tmp_path).path
        assert ours(tmp_path) == ["tkv-eng0.live"]  # the name is gone while the engine runs
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert f"{path} (deleted)" in maps  # only its mapping keeps the memory: the kernel frees it with the process
        with pytest.raises(ConfigError, match="in use by a live engine"):
            SharedSegment.open(info(tmp_path), scheduler=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
    assert ours(tmp_path) == ["tkv-eng0.live"]  # an empty lock file, no segment
    assert os.path.getsize(tmp_path / "tkv-eng0.live") == 0
    assert reclaim_dead(str(tmp_path)) == ["tkv-eng0.live"]  # the next start takes it away
    seg = SharedSegment.open(info(tmp_path), scheduler=True)  # the restart: a fresh segment
    assert not seg.blocks.any()
    seg.unlink_name()
    seg.close()
    assert ours(tmp_path) == []
