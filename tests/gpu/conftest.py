"""GPU tests: CUDA modules load eagerly, and every kernel the ordering tests use is warmed up first.

With lazy module loading (torch's default, ``CUDA_MODULE_LOADING=LAZY``) a kernel's
first launch may load its module and synchronise the context, which ends a
parked ``torch.cuda._sleep`` early and trips the "finished too early" checks on
a cold run. The variable counts only if it is set before torch initialises CUDA
(this conftest is imported at collection, before any test runs); the warm-up
covers a suite in which another directory's test initialised CUDA first.
"""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


@pytest.fixture(scope="session", autouse=True)
def warm_cuda_kernels() -> None:
    import torch

    if not torch.cuda.is_available():
        return
    from tiered_kv.transfer import CUDAStreamEngine

    async def warm() -> None:
        for block_bytes in ((1 << 20, 4096), (8192, 300, 64), (64,)):
            for layout in ("slab", "separate"):
                gpu = [torch.zeros((8, b), dtype=torch.uint8, device="cuda") for b in block_bytes]
                if layout == "slab":
                    slab = torch.zeros((8, sum(block_bytes)), dtype=torch.uint8).pin_memory()
                    cpu = list(torch.split(slab, list(block_bytes), dim=1))
                else:
                    cpu = [torch.zeros((8, b), dtype=torch.uint8).pin_memory() for b in block_bytes]
                async with CUDAStreamEngine(gpu, cpu) as engine:
                    for ids in ([0, 1, 2, 3], [5, 1, 7, 2]):  # consecutive rows and an index
                        await engine.submit_store(ids, [0, 1, 2, 3])
                        await engine.submit_load([0, 1, 2, 3], ids)
                idx = torch.tensor([1, 2], device="cuda")
                for g in gpu:
                    g.index_fill_(0, idx, 7)
                    g.fill_(1)
                    torch.index_select(g, 0, idx)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()

    asyncio.run(warm())


@pytest.fixture
def shm_path():
    """A fresh directory on /dev/shm for shared CPU-tier segments: CUDA page-locks a shared mapping only on
    tmpfs or hugetlbfs, and pytest's tmp_path may be on a disk filesystem (ext4 /tmp on the H200 host)."""
    import shutil
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here: a segment to page-lock needs a tmpfs")
    path = tempfile.mkdtemp(prefix="tkv-gpu-test-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
