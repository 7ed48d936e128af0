"""Handlers for GPU <-> CPU jobs: a thin layer over a copy engine (host threads or CUDA streams)."""

from __future__ import annotations

import numpy as np

from ...errors import TransferError
from ...media import CPU_TO_GPU, GPU_TO_CPU
from ..engines.base import CopyEngine, Direction, InlineCopies, NowCopies, ThreadedCopies
from .dispatch import CopyJob, Dispatcher, HandOff, Inline, WouldBlock


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


def inline_copy(engine: CopyEngine, direction: Direction) -> Inline | None:
    """The engine's synchronous copy (``copy_inline``: host engines only), or None: a CUDA copy
    always ends later, on its stream."""
    if not isinstance(engine, InlineCopies):
        return None
    copy = engine.copy_inline
    return lambda job: copy(direction, job.src_ids, job.dst_ids)


def hand_off(engine: CopyEngine, direction: Direction) -> HandOff | None:
    """How ``engine`` starts a copy it finishes later, or None: for a caller on the loop its one-hand-off
    threaded copy (``copy_threaded``: host engines), for a caller off the loop its loop-free queueing
    (``copy_now``: the cross-process proxy engine)."""
    threaded = engine.copy_threaded if isinstance(engine, ThreadedCopies) else None
    now = engine.copy_now if isinstance(engine, NowCopies) else None
    if threaded is None and now is None:
        return submitted(engine, direction) if isinstance(engine, CopyEngine) else None

    def start(job: CopyJob, done, out) -> None:
        if not out.on_loop and now is not None:
            now(direction, job.src_ids, job.dst_ids, done)
        elif out.on_loop and threaded is not None:
            threaded(direction, job.src_ids, job.dst_ids, out(), done)
        else:
            raise WouldBlock

    return start


def submitted(engine: CopyEngine, direction: Direction) -> HandOff:
    """For an engine that ends every copy later on its own (CUDA streams, the direct road): a caller on the
    loop submits the batch at once, ordered after the job's ``compute``, and hears of its end from the
    engine's future: no task, no coroutine and no await per call (issue 46 item 7)."""
    submit = engine.submit_store if direction is Direction.STORE else engine.submit_load

    def start(job: CopyJob, done, out) -> None:
        if not out.on_loop:
            raise WouldBlock
        handle = submit(job.src_ids, job.dst_ids, compute=job.compute)
        out()  # the caller's future, made now: the copy ends later
        handle.future.add_done_callback(lambda f: done(_error(f)))

    return start


def _error(future) -> BaseException | None:
    if future.cancelled():  # the engine's own future: nobody but the engine should end it
        return TransferError("the copy engine cancelled a batch before it landed")
    return future.exception()


def register_engine(dispatcher: Dispatcher, engine: CopyEngine) -> None:
    """GPU <-> CPU through ``engine``: awaited batches, plus whatever copies it starts at once."""
    for route, handler, direction in (
        (GPU_TO_CPU, store_handler(engine), Direction.STORE),
        (CPU_TO_GPU, load_handler(engine), Direction.LOAD),
    ):
        dispatcher.register(
            route, handler, inline=inline_copy(engine, direction), hand_off=hand_off(engine, direction)
        )
