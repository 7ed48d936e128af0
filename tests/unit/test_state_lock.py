"""The state lock the scheduler's loop shares with vLLM's thread (state_lock.py, loops.LoopThread(lock=...)):
the loop never runs a callback while another thread holds it, and a caller gets it promptly while the loop
is busy."""

from __future__ import annotations

import asyncio
import threading
import time

from tiered_kv.loops import LoopThread
from tiered_kv.state_lock import StateLock


def test_the_loop_never_runs_a_callback_while_a_caller_holds_the_lock():
    lock = StateLock()
    loop_thread = LoopThread("lock-test", lock=lock)
    inside = threading.Event()  # set while the hammering thread is inside the lock
    seen: list[tuple[bool, bool]] = []  # (the loop held the lock, the caller was inside)
    stop = threading.Event()

    def record() -> None:
        seen.append((lock.held_by_me(), inside.is_set()))

    async def io_worker() -> None:  # disk I/O completing on executor threads, timers, plain callbacks
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            await loop.run_in_executor(None, time.sleep, 0.0005)
            record()
            loop.call_soon(record)
            loop.call_later(0.0002, record)
            await asyncio.sleep(0)
            record()

    futures = [loop_thread.submit(io_worker()) for _ in range(4)]

    def hammer() -> None:
        while not stop.is_set():
            with lock.held():
                inside.set()
                time.sleep(0.0003)  # a hook calling the cache
                inside.clear()
            loop_thread.wake()

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    for f in futures:
        f.result(5)
    loop_thread.stop()
    assert len(seen) > 100
    assert all(held for held, _ in seen), "a loop callback ran without the lock"
    assert not any(was_inside for _, was_inside in seen), "a loop callback ran while a caller held the lock"


def test_a_caller_gets_the_lock_promptly_while_the_loop_is_busy():
    lock = StateLock()
    loop_thread = LoopThread("lock-busy", lock=lock)
    stop = threading.Event()

    def busy() -> None:  # back-to-back callbacks of 2 ms each: the loop never idles in select
        time.sleep(0.002)
        if not stop.is_set():
            loop_thread.loop.call_soon(busy)

    loop_thread.loop.call_soon_threadsafe(busy)
    time.sleep(0.05)
    waits = []
    for _ in range(50):
        t0 = time.perf_counter()
        with lock.held():
            waits.append(time.perf_counter() - t0)
        time.sleep(0.001)
    stop.set()
    loop_thread.stop()
    waits.sort()
    assert waits[len(waits) // 2] < 0.005  # at most about one callback's time, not the loop's whole run
    assert waits[-1] < 0.05


def test_a_call_made_under_the_lock_lets_the_loop_run_it():
    lock = StateLock()
    loop_thread = LoopThread("lock-call", lock=lock)

    async def on_loop() -> bool:
        return lock.held_by_me()

    with lock.held(), lock.held():  # reentrant, and a call lets go of it entirely while it waits
        assert loop_thread.call(on_loop(), timeout=5) is True
        assert lock.held_by_me()
    loop_thread.stop()
