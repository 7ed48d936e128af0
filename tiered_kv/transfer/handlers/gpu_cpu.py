"""Handlers for GPU <-> CPU jobs: a thin layer over a copy engine (host threads or CUDA streams)."""

from __future__ import annotations

import numpy as np

from ..engines.base import CopyEngine, Direction
from .dispatch import CopyJob, Dispatcher, InlineHandler, NowStarter, ThreadedStarter


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


def now_starter(engine: CopyEngine, direction: Direction) -> NowStarter | None:
    """The engine's loop-free queueing (``copy_now``: the cross-process proxy engine), or None."""
    start = getattr(engine, "copy_now", None)
    if start is None:
        return None

    def run(job: CopyJob, done) -> None:
        start(direction, job.src_ids, job.dst_ids, done)

    return run


def register_engine(dispatcher: Dispatcher, engine: CopyEngine) -> None:
    """GPU <-> CPU through ``engine``: awaited batches, plus the inline and threaded copies a host engine offers."""
    dispatcher.register("gpu", "cpu", store_handler(engine))
    dispatcher.register("cpu", "gpu", load_handler(engine))
    for (src, dst), direction in ((("gpu", "cpu"), Direction.STORE), (("cpu", "gpu"), Direction.LOAD)):
        inline, threaded = inline_handler(engine, direction), threaded_starter(engine, direction)
        if inline is not None:
            dispatcher.register_inline(src, dst, inline)
        if threaded is not None:
            dispatcher.register_threaded(src, dst, threaded)
        now = now_starter(engine, direction)
        if now is not None:
            dispatcher.register_now(src, dst, now)
