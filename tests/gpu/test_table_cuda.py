"""The copy paths on a CUDA device (issue 38): table, table-direct and groups move the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv.transfer.engines import CUDAStreamEngine, table_kernel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["table", "table-direct", "groups"])
@pytest.mark.parametrize("placement", ["separate", "one-allocation"])
async def test_every_copy_path_round_trips_scattered_blocks_bit_exact(path, placement):
    if path != "groups" and not table_kernel.available():
        pytest.skip("triton is not importable with this torch")
    layers, width, nb, ns, n = 32, 4096 + 8, 96, 80, 64
    if placement == "separate":  # Llama-style: K and V of each layer in allocations of their own
        gpu = [torch.randint(0, 256, (nb, width), dtype=torch.uint8, device="cuda") for _ in range(2 * layers)]
    else:  # vLLM 0.32: every layer of the group side by side in one backing allocation per block
        base = torch.randint(0, 256, (nb, 2 * layers * width), dtype=torch.uint8, device="cuda")
        gpu = [base[:, r * width : (r + 1) * width] for r in range(2 * layers)]
    slab = torch.zeros((ns, 2 * layers * width), dtype=torch.uint8).pin_memory()
    cpu = list(torch.split(slab, [width] * 2 * layers, dim=1))
    rng = np.random.default_rng(1)
    g = rng.choice(nb, n, replace=False)
    s = rng.choice(ns, n, replace=False)
    async with CUDAStreamEngine(gpu, cpu, copy_path=path, staging_bytes=5 * 2 * layers * width) as engine:
        assert engine.copy_path == path
        expect = [t[torch.from_numpy(g).cuda()].cpu() for t in gpu]
        await engine.submit_store(g, s)
        for r in (0, 1, 2 * layers - 1):
            assert torch.equal(cpu[r][torch.from_numpy(s)], expect[r]), f"store, region {r}"
        back = rng.choice(nb, n, replace=False)
        await engine.submit_load(s, back)
        torch.cuda.synchronize()
        for r in range(2 * layers):
            assert torch.equal(gpu[r][torch.from_numpy(back).cuda()].cpu(), expect[r]), f"load, region {r}"
