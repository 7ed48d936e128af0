"""Start a step's cache calls so that every job they create rides in that step's metadata.

The cache's ``load``/``store`` run as tasks on the scheduler's loop. Started and left alone, a task
queues its copy job on the proxy engine whenever the loop gets to it, racing the engine's thread that
takes the step's jobs (``ProxyCopyEngine.take_jobs``). These helpers (run on the loop, inside one
``loops.LoopThread.call``) start the tasks and turn the loop until each has queued its job, finished,
or is waiting for something that takes longer than a step (room held by copies in flight, a key
another call is storing): those ride in a later step, which is still correct for a store (its blocks
are held until it resolves) and is never done for a synchronous load (see ``start_sync_load``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .proxy_engine import ProxyCopyEngine, request_scope

SPIN_LIMIT = 200  # loop turns a plan may take (a store is queued after a few)
SPIN_BUDGET_S = 0.005  # and wall time: the engine's thread waits for this call


def _as_future(task: asyncio.Task) -> concurrent.futures.Future:
    """A thread-safe view of a loop task's outcome (read from the engine's thread)."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def settle(t: asyncio.Task) -> None:
        if t.cancelled():
            out.cancel()
            out.set_running_or_notify_cancel()
        elif t.exception() is not None:
            out.set_exception(t.exception())
        else:
            out.set_result(t.result())

    task.add_done_callback(settle)
    return out


async def _spin(ready: Callable[[], bool]) -> None:
    deadline = time.perf_counter() + SPIN_BUDGET_S
    for _ in range(SPIN_LIMIT):
        if ready() or time.perf_counter() > deadline:
            return
        await asyncio.sleep(0)


def start_tagged(tag: str, coro: Awaitable[Any]) -> asyncio.Task:
    """Start ``coro`` as a task whose jobs carry ``tag`` (the proxy's request scope is a contextvar)."""
    with request_scope(tag):
        return asyncio.ensure_future(coro)


async def run_tagged(tag: str, coro: Awaitable[Any]) -> Any:
    """Await ``coro`` with its jobs tagged ``tag`` (for a ``LoopThread.submit`` that nobody waits on here)."""
    return await start_tagged(tag, coro)


async def gather_loads(loads: Sequence[Awaitable[int]]) -> list[int]:
    """Several groups' loads as one: the blocks each landed (a failed one landed none)."""
    out = await asyncio.gather(*loads, return_exceptions=True)
    return [0 if isinstance(n, BaseException) else int(n) for n in out]


async def start_sync_load(proxy: ProxyCopyEngine, tag: str, load: Awaitable[Any], n_blocks: int, *,
                          all_or_none: bool = False) -> tuple[concurrent.futures.Future | None, int]:  # fmt: skip
    """Start a load of CPU-resident blocks and return once its job is queued: (outcome, blocks planned).

    Blocks past the planned ones are never loaded (the tag is sealed: a later chunk's job fails at
    submit), so the caller reports them as load errors in this step. When no job could be queued at
    once (a block left the CPU tier since the lookup, the byte budget is held by copies in flight), the
    load is cancelled and 0 blocks are planned. ``all_or_none``: unless every block's job is queued,
    none is kept (the queued ones are failed unsent): several groups' ranges are needed together.
    """
    task = start_tagged(tag, load)
    enough = n_blocks if all_or_none else 1
    await _spin(lambda: task.done() or proxy.queued_blocks(tag) >= enough)
    planned = min(proxy.queued_blocks(tag), n_blocks)
    if all_or_none and planned < n_blocks:
        proxy.cancel_request(tag)
        planned = 0
    proxy.seal_request(tag)
    if planned == 0:
        # Never wait for it here: what it waits for (room, the byte budget) is freed by the workers'
        # reports, which only the next step brings, and vLLM's thread is blocked on this call. Cancelled,
        # it copies nothing (the tag is sealed too) and ends on its own.
        if not task.done():
            task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return None, 0
    return _as_future(task), planned


async def start_stores(proxy: ProxyCopyEngine,
                       stores: Sequence[tuple[str, Awaitable[Any]]]) -> list[concurrent.futures.Future]:  # fmt: skip
    """Start each (tag, store) and turn the loop until every one has queued its job or finished,
    within the spin budget; returns their outcomes."""
    tasks = [(tag, start_tagged(tag, coro)) for tag, coro in stores]
    futures = [_as_future(t) for _, t in tasks]
    await _spin(lambda: all(t.done() or proxy.queued_blocks(tag) > 0 for tag, t in tasks))
    return futures
