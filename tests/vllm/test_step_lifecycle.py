"""The scheduler half's life: what close() lets go of and what it reports after (issue 45 item 6), with the
connector's real halves built as vLLM 0.32 builds them (step_harness.py), several in one process.

An in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a test suite, a notebook) builds a scheduler
half per engine; each registers a hook that closes it at exit (cache_calls.close_before_executors_exit).
Once closed, nothing of ours may keep it alive, nor may it go on saying its cache is open.
"""

from __future__ import annotations

import gc
import json
import weakref
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
from step_harness import Harness, request, store_prompt  # noqa: E402
from test_step_protocol import A  # noqa: E402

from tiered_kv.integrations.vllm.scheduler_half import SchedulerHalf  # noqa: E402

NEEDS_VLLM = True


def one_engine(tmp_path, i: int) -> weakref.ref:
    """One engine's life: its halves built, a prompt stored and hit, both halves closed; a weak reference to
    its scheduler half is all that is left here."""
    d = tmp_path / f"engine-{i}"
    d.mkdir()
    h = Harness(d)
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b = request("b", A)
    n, _ = h.admit(b, [10, 11, 12, 13])
    assert n == len(A) - 1
    h.step(new=[(b, [10, 11, 12, 13], n, 1)])
    h.idle()
    h.finish(b)
    h.idle()
    ref = weakref.ref(h.sched)
    h.close()
    return ref


def halves_alive() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is SchedulerHalf)


def test_three_closed_scheduler_halves_in_one_process_are_all_collected(tmp_path):
    gc.collect()
    before = halves_alive()  # another test's unclosed harness may hold one of its own
    refs = [one_engine(tmp_path, i) for i in range(3)]
    gc.collect()
    alive = [i for i, r in enumerate(refs) if r() is not None]
    assert alive == [], f"scheduler halves of engines {alive} are still alive after close and gc.collect()"
    assert halves_alive() == before


def test_a_half_that_never_closed_is_still_closed_by_its_exit_hook(tmp_path):
    h = Harness(tmp_path, extra={"stats_file": str(tmp_path / "stats.json")})
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        hook = h.sched._exit_hook
        hook()  # what threading runs at exit, before concurrent.futures stops its executors
        assert h.sched.report()["state"] == "closed"
        assert json.loads((tmp_path / "stats.json").read_text())["state"] == "closed"
    finally:
        h.close()  # a second close does nothing


def test_after_close_the_half_reports_its_cache_closed_and_calls_it_no_more(tmp_path):
    stats_file = tmp_path / "stats.json"
    h = Harness(tmp_path, extra={"stats_file": str(stats_file)})
    assert h.sched.report()["state"] == "open"
    store_prompt(h, "a", A, [0, 1, 2, 3])
    before = h.sched.report()
    assert before["stats"]["cpu"]["resident"] == 4  # 3 full blocks and A's tail
    assert json.loads(stats_file.read_text())["state"] == "open"
    h.close()
    after = h.sched.report()
    assert after["state"] == "closed"
    assert after["stats"] == before["stats"]  # the last stats the cache had, not a closed cache's
    written = json.loads(stats_file.read_text())  # rewritten once closed
    assert written["state"] == "closed" and written["counters"]["stored_blocks"] == 3
    # vLLM may still step a closed connector (an engine shutting down): nothing reaches the cache.
    assert not h.sched.has_jobs_in_flight()
    assert h.sched.take_events() == []
    assert h.sched.reset() is True
    late = request("late", A)
    so = NS(preempted_req_ids={"a"}, scheduled_new_reqs=[NS(req_id="late", prompt_token_ids=A, block_ids=([20, 21, 22, 23],),
                                                        num_computed_tokens=0)],
            scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()),
            num_scheduled_tokens={"late": len(A)}, finished_req_ids=set())  # fmt: skip
    h.sched.on_new_request(late)
    meta = h.sched.build_meta(so)
    assert (meta.load_jobs, meta.store_jobs, meta.fence) == ([], [], [])
    assert h.sched.request_finished(late) is False
