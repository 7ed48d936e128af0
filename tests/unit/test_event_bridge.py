"""The event -> asyncio bridge (transfer/engines/bridge.py), driven by CPU stand-in events."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tiered_kv.core import core
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.bridge import EventBridge

fake_cuda = core.fake_cuda


class ThreadEvent:
    """A stand-in for torch.cuda.Event: synchronize() blocks until set()."""

    def __init__(self, fail: bool = False) -> None:
        self._done = threading.Event()
        self._fail = fail

    def set(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait(5)
        if self._fail:
            raise RuntimeError("device lost")


async def test_bridge_resolves_in_fifo_order_without_blocking_the_loop():
    loop = asyncio.get_running_loop()
    bridge = EventBridge("test-waiter")
    events = [ThreadEvent() for _ in range(5)]
    futures = [loop.create_future() for _ in events]
    order: list[int] = []

    def resolve(fut, err):
        order.append(futures.index(fut))
        fut.set_result(err)

    for ev, fut in zip(events, futures, strict=True):
        bridge.watch(ev, fut, loop, resolve)
    await asyncio.sleep(0.02)
    assert not any(f.done() for f in futures)  # the loop ran while the waiter blocked
    for ev in reversed(events):  # completion order on the device does not matter
        ev.set()
    await asyncio.gather(*futures)
    assert order == [0, 1, 2, 3, 4]
    bridge.stop()
    await asyncio.sleep(0.05)
    assert not bridge.alive


async def test_bridge_reports_errors_after_the_event():
    loop = asyncio.get_running_loop()
    bridge = EventBridge("test-waiter")
    failing, late = ThreadEvent(fail=True), ThreadEvent()
    got: dict[str, BaseException | None] = {}
    f1, f2 = loop.create_future(), loop.create_future()

    def resolve(fut, err):
        got["f1" if fut is f1 else "f2"] = err
        fut.set_result(None)

    bridge.watch(failing, f1, loop, resolve)
    bridge.watch(late, f2, loop, resolve, error=TransferError("enqueue failed"))
    failing.set()
    await f1
    assert isinstance(got["f1"], TransferError) and isinstance(got["f1"].__cause__, RuntimeError)
    await asyncio.sleep(0.02)
    assert not f2.done()  # an enqueue error waits for the event: no copy may still run
    late.set()
    await f2
    assert str(got["f2"]) == "enqueue failed"
    bridge.stop()
    with pytest.raises(TransferError, match="stopped"):
        bridge.watch(late, loop.create_future(), loop, resolve)


async def test_bridge_runs_on_start_on_its_own_thread_before_any_wait():
    # The CUDA engine sets its device there: a wait on a thread whose current device
    # is GPU 0 would create a context on GPU 0 (TP rank > 0).
    seen: list[tuple[str, str]] = []

    class Recorded(ThreadEvent):
        def synchronize(self) -> None:
            seen.append(("wait", threading.current_thread().name))

    loop = asyncio.get_running_loop()
    bridge = EventBridge("start-waiter", on_start=lambda: seen.append(("start", threading.current_thread().name)))
    fut = loop.create_future()
    bridge.watch(Recorded(), fut, loop, lambda f, err: f.set_result(err))
    assert await fut is None
    assert seen == [("start", "start-waiter"), ("wait", "start-waiter")]
    bridge.stop()


