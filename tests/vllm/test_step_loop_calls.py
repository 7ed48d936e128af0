"""The scheduler half plans in vLLM's thread (issue 39 item 1): a hit step, a miss step and a store step with
room make no call onto the cache's loop thread; a store that must wait for room still lands later; the
tier manager is touched only under the cache's state lock, from whichever thread (state_lock.py)."""

from __future__ import annotations

import functools
import threading

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
from step_harness import BS, Harness, request, store_prompt  # noqa: E402

NEEDS_VLLM = True

PREFIX = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]  # 3 blocks
A = PREFIX + [41, 42]
B = PREFIX + [51, 52, 53]
C = [61, 62, 63, 64, 71, 72, 73, 74, 81]


class LoopSpy:
    """Counts every hop onto the scheduler's loop thread (the real LoopThread's call and submit)."""

    def __init__(self, h: Harness) -> None:
        self.calls: list[str] = []
        loop = h.sched._calls._loop
        for name in ("call", "submit"):
            real = getattr(loop, name)
            setattr(loop, name, self._counting(name, real))

    def _counting(self, name, real):
        @functools.wraps(real)
        def run(*args, **kwargs):
            self.calls.append(name)
            return real(*args, **kwargs)

        return run


class ManagerWatch:
    """Wraps the real tier manager: records each method called without the state lock held by its caller."""

    def __init__(self, h: Harness) -> None:
        self.unlocked: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        calls = h.sched._calls
        manager = calls.opened.cache.manager
        lock = calls._lock
        for name in ("prepare_load", "complete_load", "prepare_store", "complete_store", "lookup", "touch", "demote"):
            real = getattr(manager, name)
            setattr(manager, name, self._checked(name, real, lock))

    def _checked(self, name, real, lock):
        @functools.wraps(real)
        def run(*args, **kwargs):
            self.threads.add(threading.current_thread().name)
            if not lock.held_by_me():
                self.unlocked.append((name, threading.current_thread().name))
            return real(*args, **kwargs)

        return run


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_a_cpu_hit_step_makes_no_loop_call(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    spy, before = LoopSpy(h), h.counters()
    b = request("b", B)
    n, is_async = h.admit(b, [10, 11, 12, 13])  # get_num_new_matched_tokens, update_state_after_alloc
    assert (n, is_async) == (3 * BS, False)
    meta = h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n)])  # build_connector_meta ... update_connector_output
    assert meta.sync_loads and h.holds(B, [10, 11, 12], 3, kv=h.after_start)
    assert spy.calls == []
    after = h.counters()
    assert after.get("loop_calls", 0) == before.get("loop_calls", 0)
    assert after["hook_calls_matched_tokens"] > before.get("hook_calls_matched_tokens", 0)
    h.idle()
    assert h.counters()["loaded_blocks"] == 3


def test_a_miss_step_and_its_stores_make_no_loop_call(h):
    spy = LoopSpy(h)
    c = request("c", C)
    assert h.admit(c, [0, 1, 2]) == (0, False)
    meta = h.step(new=[(c, [0, 1, 2], 0, len(C))])
    assert meta.store_jobs  # planned and queued in vLLM's thread, riding in this step's metadata
    h.idle()
    assert h.counters()["stored_blocks"] == 2
    assert h.finish(c) is False
    h.idle()
    assert spy.calls == [] and h.counters().get("loop_calls", 0) == 0


def test_the_manager_is_only_touched_under_the_state_lock(h):
    watch = ManagerWatch(h)
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b, x = request("b", B), request("x", C)
    n, _ = h.admit(b, [10, 11, 12, 13])
    h.admit(x, [20, 21, 22])
    h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n), (x, [20, 21, 22], 0, len(C))])
    h.step(preempted=["x"])
    h.finish(b)
    h.idle()
    assert h.counters()["loaded_blocks"] == 3
    assert watch.unlocked == []
    assert "MainThread" in watch.threads  # planned in vLLM's thread


def test_a_store_that_must_wait_for_room_lands_later(tmp_path):
    h = Harness(tmp_path, cpu="2KiB")  # 8 slots of 256 bytes
    try:
        spy = LoopSpy(h)
        big = [100 + i for i in range(8 * BS)]
        first = request("first", big)
        h.admit(first, list(range(8)))
        h.step(new=[(first, list(range(8)), 0, len(big))], report=False)  # every slot reserved, in flight
        other = request("other", C)
        h.admit(other, [20, 21, 22])
        meta = h.step(new=[(other, [20, 21, 22], 0, len(C))])  # no room: its store waits, on the loop
        assert not [j for j in meta.store_jobs if j.req_id.startswith("other#")]
        assert spy.calls  # the waiting store went to the loop: the one hop, counted
        assert h.counters()["loop_calls_build_meta"] >= 1
        assert h.finish(other) is True  # vLLM keeps its blocks until the store resolved
        h.idle(8)
        assert h.counters()["stored_blocks"] >= 8 + 2
        assert "other" in h.finished_sending
        again = request("again", C)
        n, is_async = h.admit(again, [30, 31, 32])
        assert (n, is_async) == (2 * BS, False)
        h.step(new=[(again, [30, 31, 32], n, len(C) - n)])
        assert h.holds(C, [30, 31], 2, kv=h.after_start)
    finally:
        h.close()
