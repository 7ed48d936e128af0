"""A shared segment to page-lock must live on tmpfs or hugetlbfs: checked by statfs, refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.tiers.fs_kind import HUGETLBFS_MAGIC, TMPFS_MAGIC, check_pinnable, fs_magic, fs_name

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_dev_shm_is_tmpfs_and_passes():
    assert fs_magic("/dev/shm") == TMPFS_MAGIC and fs_name("/dev/shm") == "tmpfs"
    check_pinnable("/dev/shm")


def test_a_directory_on_a_disk_filesystem_is_refused_naming_the_setting_the_path_and_its_filesystem():
    magic = fs_magic(str(ROOT))
    if magic in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
        pytest.skip(f"the checkout itself is on {fs_name(str(ROOT))}: no disk filesystem to try")
    name = fs_name(str(ROOT))
    assert name not in ("unknown", "tmpfs")
    with pytest.raises(ConfigError) as err:
        check_pinnable(str(ROOT), why="TP rank 1's CUDA copy engine page-locks its sub-slab of the segment there")
    msg = str(err.value)
    assert f"tiers.cpu.shared_path is {str(ROOT)!r}, on a {name} filesystem (statfs f_type {magic:#x})" in msg
    assert "tmpfs or hugetlbfs" in msg and "/dev/shm" in msg and "TP rank 1" in msg
    assert "RLIMIT_MEMLOCK" not in msg


def test_a_path_that_does_not_exist_yet_is_left_to_whoever_opens_it(tmp_path):
    check_pinnable(str(tmp_path / "not-yet"))
