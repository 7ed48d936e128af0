"""Handlers for GPU <-> CPU jobs: a thin layer over a copy engine (host threads or CUDA streams)."""

from __future__ import annotations

import numpy as np

from ...media import CPU_TO_GPU, GPU_TO_CPU
from ..engines.base import CopyEngine, Direction
from .dispatch import CopyJob, Dispatcher, Start, WouldBlock


def store_handler(engine: CopyEngine):
    """GPU blocks -> CPU slots; the engine resolves the batch only once every byte has landed."""

    async def run(job: CopyJob) -> np.ndarray:
        await engine.submit_store(job.src_ids, job.dst_ids, compute=job.compute)
        return np.ones(len(job), dtype=bool)

    return run


def load_handler(engine: CopyEngine):
    """CPU slots -> GPU blocks."""

    async def run(job: CopyJob) -> np.ndarray:
        await engine.submit_load(job.src_ids, job.dst_ids, compute=job.compute)
        return np.ones(len(job), dtype=bool)

    return run


def starter(engine: CopyEngine, direction: Direction) -> Start | None:
    """How ``engine`` starts a copy without an awaited batch, or None: for a caller on the loop, its
    synchronous copy (``copy_inline``: host engines) else its one-hand-off threaded copy (``copy_threaded``);
    for a caller off the loop, its loop-free queueing (``copy_now``: the cross-process proxy engine)."""
    inline = getattr(engine, "copy_inline", None)
    threaded = getattr(engine, "copy_threaded", None)
    now = getattr(engine, "copy_now", None)
    if inline is None and threaded is None and now is None:
        return None  # a CUDA copy always ends later, on its stream: awaited batches only

    def start(job: CopyJob, done, token) -> bool:
        if token is None:
            if now is None:
                raise WouldBlock
            now(direction, job.src_ids, job.dst_ids, done)
            return False
        if inline is not None and inline(direction, job.src_ids, job.dst_ids):
            return True
        if threaded is None:
            raise WouldBlock
        threaded(direction, job.src_ids, job.dst_ids, token, done)
        return False

    return start


def register_engine(dispatcher: Dispatcher, engine: CopyEngine) -> None:
    """GPU <-> CPU through ``engine``: awaited batches, plus whatever copies it starts at once."""
    dispatcher.register(GPU_TO_CPU, store_handler(engine), start=starter(engine, Direction.STORE))
    dispatcher.register(CPU_TO_GPU, load_handler(engine), start=starter(engine, Direction.LOAD))
