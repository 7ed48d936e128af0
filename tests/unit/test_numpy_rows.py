"""The host engines' native row copies: the right bytes, checked ids, and no intra-op pool on any thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.numpy_rows import NumpyRowEngine

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("pattern", ["consecutive", "runs", "scattered"])
def test_copy_rows_matches_a_reference_gather(pattern):
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, (40, w), dtype=np.uint8) for w in (24, 8)]
    slab = np.zeros((30, 40), dtype=np.uint8)  # strided column views, as a rank's shard of a row is
    dst = [slab[:, 4:28], slab[:, 30:38]]
    if pattern == "consecutive":
        s, d = np.arange(5, 17), np.arange(3, 15)
    elif pattern == "runs":
        s, d = np.r_[0:4, 10:14, 30:33], np.r_[20:24, 0:4, 8:11]
    else:
        s, d = rng.choice(40, 20, replace=False), rng.choice(30, 20, replace=False)
    core.Rows(src, dst).copy(0, s, d)
    for a, b in zip(src, dst, strict=True):
        assert np.array_equal(b[d], a[s])
    untouched = np.setdiff1d(np.arange(30), d)
    assert not slab[untouched].any() and not slab[:, :4].any() and not slab[:, 28:30].any()


def test_row_copies_check_their_ids_before_copying():
    src, slab = [np.arange(40, dtype=np.uint8).reshape(10, 4)], np.zeros((6, 4), dtype=np.uint8)
    rows = core.Rows(src, [slab], "gpu block id", "cpu slot")
    for s, d, msg in (([0, 10], [0, 1], "gpu block id 10 out of range"), ([0, 1], [0, -1], "cpu slot -1 out of range"),
                      ([0, 1], [2, 2], "duplicate cpu slot 2"), ([0], [0, 1], "length mismatch: 1 gpu block ids"),
                      ([0.5], [1], "gpu block ids must be integers")):  # fmt: skip
        with pytest.raises(TransferError, match=msg):
            rows.copy(0, np.array(s), np.array(d))
    assert not slab.any()
    rows.copy(0, np.array([], dtype=np.int64), np.array([], dtype=np.int64))  # empty: nothing to read
    rows.copy(0, [], [])
    rows.copy(1, np.array([5]), np.array([9]))  # side 1 -> side 0: the slab's row into block 9
    assert not src[0][9].any()
    with pytest.raises(TransferError, match="writable"):
        core.Rows([src[0][:, ::2]], [slab[:, :2]])


async def test_the_engine_stores_and_loads_byte_exact():
    gpu = [torch.randint(0, 256, (16, 96), dtype=torch.uint8), torch.randint(0, 256, (16, 32), dtype=torch.uint8)]
    slab = torch.zeros(8, 128, dtype=torch.uint8)
    cpu = [slab[:, :96], slab[:, 96:]]
    async with NumpyRowEngine(gpu, cpu) as engine:
        await engine.submit_store([3, 9, 4], [0, 5, 6])
        await engine.submit_load([5, 0], [14, 15])
    for g in gpu:
        assert torch.equal(g[14], g[9]) and torch.equal(g[15], g[3])
    assert torch.equal(slab[6, :96], gpu[0][4])


PROBE = textwrap.dedent("""
    import asyncio, os, sys
    import numpy as np, torch
    from concurrent.futures import ThreadPoolExecutor
    from tiered_kv.transfer.engines.host import HostCopyEngine
    from tiered_kv.transfer.engines.numpy_rows import NumpyRowEngine
    kind = sys.argv[1]
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # the main thread's pool is up
    gpu = [torch.randint(0, 255, (256, 32768), dtype=torch.uint8) for _ in range(2)]
    slab = torch.zeros(128, 65536, dtype=torch.uint8)
    cpu = [slab[:, :32768], slab[:, 32768:]]
    def gather():  # what the torch host engine did on its own thread: 2 MiB copy_ per region
        for s in range(0, 192, 16):
            for g, c in zip(gpu, cpu):
                c[:64].copy_(g[s : s + 64])
    async def main():
        if kind == "torch":
            with ThreadPoolExecutor(1) as pool:
                pool.submit(lambda: None).result()  # the thread is up
                before = len(os.listdir("/proc/self/task"))
                pool.submit(gather).result()
                print(len(os.listdir("/proc/self/task")) - before)
            return
        e = (HostCopyEngine if kind == "host" else NumpyRowEngine)(gpu, cpu, inline_bytes=0)
        await e.submit_store(np.array([5]), np.array([1]))  # the engine's own thread is up
        before = len(os.listdir("/proc/self/task"))
        for s in range(0, 192, 16):  # runs of 64 consecutive blocks: one 2 MiB copy per region
            await e.submit_store(np.arange(s, s + 64), np.arange(64))
        await e.submit_store(np.arange(0, 128, 2), np.arange(64))  # a gather
        print(len(os.listdir("/proc/self/task")) - before)
        await e.aclose()
    asyncio.run(main())
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
                    reason="needs Linux and torch with an intra-op pool of 2+ threads")  # fmt: skip
def test_numpy_copies_start_no_intra_op_pool_on_the_engines_thread():
    """torch ops on a foreign thread start a second pool that competes with the engine's forward pass;
    neither host engine runs one (issue 28: host copies single-threaded)."""

    def new_threads(kind: str) -> int:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True, env=env,
                             timeout=120, check=True)  # fmt: skip
        return int(out.stdout.strip().splitlines()[-1])

    assert new_threads("torch") >= 1  # the probe does see the effect it guards against
    assert new_threads("host") == 0
    assert new_threads("numpy") == 0
