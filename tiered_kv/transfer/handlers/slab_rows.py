"""The handler for rows restaged within the CPU slab (route CPU -> CPU): an exclusive load's CPU hits
copied into its staging rows before their CPU slots are let go."""

from __future__ import annotations

import asyncio

import numpy as np

from ...media import RESTAGE
from .dispatch import CopyJob, Dispatcher

INLINE_COPY_BYTES = 1 << 20  # copies up to this size run on the loop: a thread hand-off costs more


def restage_handler(slab: np.ndarray, bytes_per_block: int):
    """``slab``: the CPU slab's numpy view (``CpuSlabs.slab_np``), one row per slot or staging row."""

    async def run(job: CopyJob) -> np.ndarray:
        src, dst = job.src_ids, job.dst_ids

        def copy() -> None:
            slab[dst] = slab[src]

        if len(src) * bytes_per_block <= INLINE_COPY_BYTES:
            copy()
        else:
            await asyncio.get_running_loop().run_in_executor(None, copy)
        return np.ones(len(job), dtype=bool)

    return run


def register_slab(dispatcher: Dispatcher, slab: np.ndarray, bytes_per_block: int) -> None:
    dispatcher.register(RESTAGE, restage_handler(slab, bytes_per_block))
