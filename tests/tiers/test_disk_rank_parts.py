"""The disk tier moves a whole TP block straight from the ranks' sub-slabs of the rank-major segment:
one iovec per rank per record, byte-for-byte the record a contiguous (interleaved) row gives, so a disk tier
written by either layout reads back into the other. Real files and a real segment throughout."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from disk_helpers import key_rows

from tiered_kv.errors import LayoutError
from tiered_kv.tiers.disk import DiskNamespace, DiskStore
from tiered_kv.tiers.disk.records import IOV_MAX
from tiered_kv.tiers.shared_cpu import SegmentInfo, SharedSegment

SHARD = 4096 + 100  # not a page multiple: each rank's piece of a record starts unaligned in the file


def keys_for(n: int) -> list[bytes]:
    return [hashlib.sha256(f"parts{i}".encode()).digest() for i in range(n)]


def segment(tmp_path, world: int, slots: int, name: str) -> SharedSegment:
    return SharedSegment.open(SegmentInfo.for_engine(str(tmp_path), name, world_size=world, shard_bytes=SHARD,
                                                     num_slots=slots))  # fmt: skip


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
async def test_records_from_rank_pieces_are_the_contiguous_rows_records(tmp_path, world, direct):
    n, bpb = 40, world * SHARD
    ns = DiskNamespace("parts-model", "float16", f"parts-{world}", bpb, 32)
    rows = np.random.default_rng(world).integers(0, 256, (n, bpb), dtype=np.uint8)  # whole blocks, rank order
    seg = segment(tmp_path, world, n + 8, "src")
    seg.blocks[8:] = rows.reshape(n, world, SHARD)  # slot 8 + i holds block i, rank r's piece in sub-slab r
    disk_slots = np.r_[np.arange(0, 30), np.arange(50, 60)]  # two runs
    keys = key_rows(keys_for(n))
    async with DiskStore(tmp_path / "a", ns, 64, o_direct=direct) as a, \
            DiskStore(tmp_path / "b", ns, 64, o_direct=direct) as b:  # fmt: skip
        if direct and not a.o_direct_active:
            pytest.skip(f"O_DIRECT unusable here: {a.o_direct_reason}")
        assert (await a.write_many(disk_slots, keys, seg.blocks, np.arange(8, 8 + n))).all()
        assert (await b.write_many(disk_slots, keys, rows, np.arange(n))).all()  # today's contiguous rows
        if not direct:
            assert a.write_syscalls == 2  # one pwritev per run of slots, whatever the number of ranks
        with open(os.path.join(a.path, "blocks.dat"), "rb") as fa, open(os.path.join(b.path, "blocks.dat"), "rb") as fb:
            assert fa.read() == fb.read()  # the same records: rank 0 .. N-1 byte order, same checksums
        back = segment(tmp_path, world, n, "dst")
        order = np.arange(n)[::-1].copy()
        assert (await a.read_many(disk_slots, keys, back.blocks, order)).all()
        assert np.array_equal(back.blocks[order].reshape(n, bpb), rows)
        flat = np.zeros((n, bpb), np.uint8)  # and records written from the pieces read into contiguous rows
        assert (await b.read_many(disk_slots, keys, flat, np.arange(n))).all()
        assert np.array_equal(flat, rows)
        back.blocks[:] = 0
        assert (await b.read_many(disk_slots, keys, back.blocks, np.arange(n))).all()
        assert np.array_equal(back.blocks.reshape(n, bpb), rows)
        back.close()
    seg.close()


async def test_a_run_is_cut_to_fit_iov_max_with_one_iovec_per_rank(tmp_path):
    world, n = 4, 400  # 5 iovecs per record: a run holds at most (IOV_MAX - 1) // 5 records
    ns = DiskNamespace("parts-model", "float16", "parts-iov", world * SHARD, 32)
    seg = segment(tmp_path, world, n, "iov")
    seg.blocks[:] = np.random.default_rng(1).integers(0, 256, seg.blocks.shape, dtype=np.uint8)
    async with DiskStore(tmp_path / "d", ns, n) as store:
        keys = key_rows(keys_for(n))
        assert (await store.write_many(np.arange(n), keys, seg.blocks, np.arange(n))).all()
        assert store.write_syscalls == -(-n // ((IOV_MAX - 1) // 5))
        back = np.zeros((n, world * SHARD), np.uint8)
        assert (await store.read_many(np.arange(n), keys, back, np.arange(n))).all()
        assert np.array_equal(back, seg.blocks.reshape(n, -1))
    seg.close()


async def test_a_block_view_that_does_not_hold_a_whole_block_is_refused(tmp_path):
    ns = DiskNamespace("parts-model", "float16", "parts-bad", 2 * SHARD, 32)
    seg = segment(tmp_path, 3, 4, "bad")
    async with DiskStore(tmp_path / "d", ns, 8) as store:
        with pytest.raises(LayoutError, match=f"ranks x shard = {2 * SHARD}"):
            await store.write_many(np.arange(2), key_rows(keys_for(2)), seg.blocks, np.arange(2))
    seg.close()
