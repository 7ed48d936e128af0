"""The disk tier's I/O goes through aiofiles on the tier's own threads: the data file's vectored calls one
per run of consecutive slots (never one per record), every file call on at most ``io_threads`` threads of
the tier's pool (never the loop's default executor, never the loop thread), the journal an aiofiles file."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

import numpy as np
from aiofiles.threadpool.binary import AsyncFileIO
from disk_helpers import get, payload, put

from tiered_kv.tiers.disk import DiskNamespace, DiskStore

BPB = 8192
NS = DiskNamespace("aio-model", "float16", "aio-layout", BPB, 32)


def key_of(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"aio{salt}{i}".encode()).digest()


async def test_vectored_calls_run_one_per_run_on_the_tiers_own_threads(tmp_path, monkeypatch):
    calls: list[tuple[str, str]] = []  # (syscall, thread name)
    for name in ("pwritev", "preadv", "fsync", "fdatasync"):
        real = getattr(os, name)

        def record(*args, real=real, name=name):
            calls.append((name, threading.current_thread().name))
            return real(*args)

        monkeypatch.setattr(os, name, record)
    loop_thread = threading.current_thread().name
    slots = np.r_[np.arange(0, 20), np.arange(30, 54), np.arange(60, 80)]  # 64 blocks in 3 runs
    keys = [key_of(i) for i in range(64)]
    async with DiskStore(tmp_path, NS, 128, io_threads=2, fsync=True) as store:
        assert isinstance(store._journal.file, AsyncFileIO)  # the journal is an aiofiles file
        calls.clear()
        writes = [put(store, slots[i::4], [keys[j] for j in range(i, 64, 4)]) for i in range(4)]
        assert all(ok.all() for ok in await asyncio.gather(*writes))  # four batches at once
        assert [c for c, _ in calls].count("pwritev") == store.write_syscalls == 4 * 64 // 4  # no run: 1 each
        calls.clear()
        assert await get(store, slots, keys) == [payload(k, BPB) for k in keys]
        assert [c for c, _ in calls] == ["preadv"] * 3  # one per run
        calls.clear()
        new = [key_of(i, "new") for i in range(64)]
        assert (await put(store, slots, new)).all()
        assert [c for c, _ in calls].count("pwritev") == 3
        assert "fdatasync" in [c for c, _ in calls]  # fsync: true goes through the same pool
    threads = {t for _, t in calls}
    assert loop_thread not in threads
    assert threads and all(t.startswith("tkv-disk_") for t in threads), threads
    assert len(threads) <= 2  # tiers.disk.io_threads holds
