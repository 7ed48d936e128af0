"""Handlers for GPU <-> CPU jobs: a thin layer over a copy engine (host threads or CUDA streams)."""

from __future__ import annotations

import numpy as np

from ..transfer.base import CopyEngine, Direction
from .mover import CopyJob, InlineHandler, ThreadedStarter


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


def inline_handler(engine: CopyEngine, direction: Direction) -> InlineHandler | None:
    """The engine's synchronous copy (``copy_inline``: host engines only), or None: a CUDA copy
    always ends later, on its stream."""
    copy = getattr(engine, "copy_inline", None)
    if copy is None:
        return None

    def run(job: CopyJob) -> bool:
        return copy(direction, job.src_ids, job.dst_ids)

    return run


def threaded_starter(engine: CopyEngine, direction: Direction) -> ThreadedStarter | None:
    """The engine's one-hand-off threaded copy (``copy_threaded``: host engines only), or None."""
    start = getattr(engine, "copy_threaded", None)
    if start is None:
        return None

    def run(job: CopyJob, token, done) -> None:
        start(direction, job.src_ids, job.dst_ids, token, done)

    return run
