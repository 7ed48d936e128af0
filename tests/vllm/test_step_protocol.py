"""The connector's step protocol, with its real halves driven as vLLM 0.32 drives them (step_harness.py).

Each test names the defect it holds shut: stores issued before the forward, a CPU hit served steps
late, a request id that comes back, a preemption fence that is a full barrier, a failing load promised
forever, sets that grow forever, a reset that forgets nothing, a shutdown that waits a minute.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
from step_harness import BS, Harness, request, store_prompt  # noqa: E402

NEEDS_VLLM = True

PREFIX = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34]  # 3 blocks
A = PREFIX + [41, 42]
B = PREFIX + [51, 52, 53]
C = [61, 62, 63, 64, 71, 72, 73, 74, 81]  # 2 full blocks


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_a_cpu_hit_is_loaded_in_the_step_it_is_found_before_that_steps_forward(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b = request("b", B)
    n, is_async = h.admit(b, [10, 11, 12, 13])
    assert (n, is_async) == (3 * BS, False)  # synchronous: vLLM schedules b's forward in this very step
    assert h.sched.hit_sources("b", n) == {"cpu": n}  # vLLM's hit metrics: all from the host tier
    meta = h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n)])
    assert len(meta.sync_loads) == 1 and meta.load_jobs[0].job_id == meta.sync_loads[0]
    assert h.holds(B, [10, 11, 12], 3, kv=h.after_start)  # landed when start_load_kv returned
    assert h.load_errors[-1] == set()
    h.idle()
    assert h.counters()["loaded_blocks"] == 3


def test_stores_of_a_step_with_a_synchronous_load_read_what_its_forward_wrote(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b, c = request("b", B), request("c", C)
    n, _ = h.admit(b, [10, 11, 12, 13])
    assert h.admit(c, [20, 21, 22]) == (0, False)
    meta = h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n), (c, [20, 21, 22], 0, len(C))])
    assert meta.sync_loads and meta.store_jobs  # c's stores ride in the step that computes its blocks
    h.idle()
    h.finish(c)
    h.idle()
    c2 = request("c2", C)
    n2, is_async = h.admit(c2, [30, 31, 32])
    assert (n2, is_async) == (2 * BS, False)
    h.step(new=[(c2, [30, 31, 32], n2, len(C) - n2)])
    assert h.holds(C, [30, 31], 2, kv=h.after_start)  # the bytes the forward wrote, not the zeros before it


def test_a_request_id_scheduled_again_keeps_its_stores_in_flight(h):
    # A streaming-input session: its next chunk is scheduled as a new request under the same id.
    x = request("x", C[:8])
    h.admit(x, [0, 1])
    h.step(new=[(x, [0, 1], 0, 8)], report=False)  # its 2 blocks' store is in flight
    grown = request("x", C[:8] + [91, 92])  # the next chunk adds no full block: no store of its own
    h.sched.on_new_request(grown)
    h.step(new=[(grown, [0, 1, 2], 8, 2)], report=False)
    assert h.counters()["readmitted_requests"] == 1
    # The first chunk's store still reads blocks 0 and 1: vLLM must keep them until it resolves.
    assert h.finish(grown) is True
    h.idle(5)
    assert h.counters()["stored_blocks"] == 2
    assert h.finished_sending == {"x"}


def test_a_preempted_request_resumed_as_new_stores_again_under_a_new_tag(h):
    x = request("x", C)
    h.admit(x, [0, 1, 2])
    h.step(new=[(x, [0, 1, 2], 0, len(C))])  # its store is in flight
    meta = h.step(preempted=["x"])  # V2 model runner: preempted ...
    assert meta.fence  # the sent store is fenced: the workers wait for it before the forward
    assert h.counters()["fenced_preemptions"] == 1
    h.idle()
    again = request("x", C)
    h.sched.on_new_request(again)
    h.step(new=[(again, [5, 6, 7], 0, len(C))])  # ... and resumed as a new request
    h.idle()
    y = request("y", C)
    n, _ = h.admit(y, [10, 11, 12])
    assert n == 2 * BS
    h.step(new=[(y, [10, 11, 12], n, len(C) - n)])
    assert h.holds(C, [10, 11], 2, kv=h.after_start)


def test_the_preemption_fence_waits_only_for_the_preempted_requests_stores(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    x, b = request("x", C), request("b", B)
    h.admit(x, [20, 21, 22])
    h.step(new=[(x, [20, 21, 22], 0, len(C))])
    n, _ = h.admit(b, [10, 11, 12, 13])
    meta = h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n)], preempted=["x"])
    store_ids = {j.job_id for m in h.metas for j in m.store_jobs if j.req_id.startswith("x#")}
    assert set(meta.fence) <= store_ids and meta.fence  # no load, no other request's job
    assert not (set(meta.fence) & set(meta.sync_loads))


def test_a_load_that_failed_is_not_promised_again(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b = request("b", B)
    n, _ = h.admit(b, [10, 11, 12, 13])
    h.fail_sync_loads = True  # the rank reports its copy failed: vLLM recomputes, and must not be promised it again
    h.step(new=[(b, [10, 11, 12, 13], n, len(B) - n)])
    h.fail_sync_loads = False
    h.idle()
    assert h.sched.matched_tokens(b, 0) == (0, False)


def test_the_worker_remembers_only_the_finished_requests_it_must_answer_for(h):
    for i in range(2000):
        h.worker.finished({f"done-{i}"})
    assert len(h.worker._finished_seen) == 0 and len(h.worker._held) == 0


def test_reset_forgets_every_block_and_refuses_while_jobs_are_in_flight(h):
    x = request("x", C)
    h.admit(x, [0, 1, 2])
    h.step(new=[(x, [0, 1, 2], 0, len(C))])
    assert h.sched.reset() is False  # its store is still in flight
    h.idle()
    h.finish(x)
    h.idle()
    assert h.sched.reset() is True
    y = request("y", C)
    assert h.admit(y, [10, 11, 12]) == (0, False)


def test_shutdown_with_jobs_no_worker_will_report_takes_seconds_not_the_report_timeout(tmp_path):
    h = Harness(tmp_path)
    x = request("x", C)
    h.admit(x, [0, 1, 2])
    h.sched.build_meta(type("S", (), {"preempted_req_ids": set(), "num_scheduled_tokens": {"x": len(C)},
                                      "scheduled_new_reqs": [type("N", (), {"req_id": "x", "prompt_token_ids": C,
                                                                            "block_ids": ([0, 1, 2],),
                                                                            "num_computed_tokens": 0})()],
                                      "scheduled_cached_reqs": type("C", (), {"req_ids": [], "new_block_ids": [],
                                                                             "num_computed_tokens": []})()})())  # fmt: skip
    assert h.sched.has_jobs_in_flight()  # sent, and no worker will ever report it
    t0 = time.monotonic()
    h.sched.close()
    assert time.monotonic() - t0 < 10
    h.worker.close()


def test_a_cpu_hit_that_cannot_copy_at_once_is_asynchronous_and_never_blocks_the_step(tmp_path):
    # The byte budget is held by stores no step has reported yet: a synchronous load would wait for
    # reports that only a later step brings, while vLLM's thread waits for it (a deadlock). It goes async.
    h = Harness(tmp_path, inflight="256B")  # one block's copy at a time
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        x = request("x", C)
        h.admit(x, [20, 21, 22])
        h.step(new=[(x, [20, 21, 22], 0, len(C))], report=False)  # its store holds the budget, unreported
        b = request("b", B)
        t0 = time.monotonic()
        n, is_async = h.admit(b, [10, 11, 12, 13])
        assert time.monotonic() - t0 < 5
        assert (n, is_async) == (3 * BS, True)
        for _ in range(20):
            h.step()
            if "b" in h.finished_recving:
                break
        assert "b" in h.finished_recving and h.holds(B, [10, 11, 12], 3)
    finally:
        h.close()


def test_a_synchronous_load_that_cannot_queue_returns_at_once_without_waiting_for_it():
    import asyncio

    from tiered_kv.cross_process import ProxyCopyEngine, start_sync_load

    async def run():
        proxy = ProxyCopyEngine(1, 8, 8)
        gate = asyncio.Event()  # what the load waits for (room, the byte budget): freed by a later step only

        async def load():  # like the cache's load, a cancel ends it only once what it waits for is over
            try:
                await gate.wait()
            except asyncio.CancelledError:
                await gate.wait()
                raise
            return 0

        t0 = time.monotonic()
        future, planned = await asyncio.wait_for(start_sync_load(proxy, "r#1", load(), 3), 5)
        took = time.monotonic() - t0
        gate.set()  # the next step's reports
        await asyncio.sleep(0.01)
        return future, planned, took

    future, planned, took = asyncio.run(run())
    assert (future, planned) == (None, 0) and took < 1
