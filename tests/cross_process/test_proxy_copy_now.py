"""ProxyCopyEngine.copy_now: a job queued from the scheduler's own thread, with no asyncio future; its
``done`` runs once every rank reported it (the all-ranks rule of every job), or once it failed."""

from __future__ import annotations

import asyncio

import numpy as np

from tiered_kv.cross_process import LOAD, STORE, ProxyCopyEngine, request_scope
from tiered_kv.errors import TransferError
from tiered_kv.transfer.engines.base import Direction


def test_a_copy_now_job_is_done_only_when_every_rank_reported():
    proxy = ProxyCopyEngine(2, num_blocks=8, num_slots=4)  # built off any loop: no report timer
    done: list = []
    with request_scope("r#1"):
        proxy.copy_now(Direction.STORE, np.array([3, 4]), np.array([0, 1]), done.append)
        proxy.copy_now(Direction.LOAD, np.array([2]), np.array([5]), done.append)
    jobs = proxy.take_jobs()
    assert [(j.direction, j.req_id) for j in jobs] == [(STORE, "r#1"), (LOAD, "r#1")]
    assert jobs[0].gpu_ids.tolist() == [3, 4] and jobs[1].gpu_ids.tolist() == [5] and jobs[1].cpu_slots.tolist() == [2]
    proxy.report(0, [j.job_id for j in jobs])
    assert done == []  # rank 1 has not reported
    proxy.report(1, [jobs[0].job_id], [jobs[1].job_id])
    assert done[0] is None and isinstance(done[1], TransferError)
    assert proxy.inflight == 0


def test_a_copy_now_job_of_a_cancelled_request_fails_and_a_queued_one_is_failed_by_the_cancel():
    proxy = ProxyCopyEngine(1, num_blocks=8, num_slots=4)
    done: list = []
    with request_scope("r#1"):
        proxy.copy_now(Direction.LOAD, np.array([0]), np.array([1]), done.append)
    assert proxy.cancel_request("r#1") == 1
    with request_scope("r#1"):
        proxy.copy_now(Direction.LOAD, np.array([0]), np.array([1]), done.append)
    assert len(done) == 2 and all(isinstance(e, TransferError) for e in done)
    assert proxy.take_jobs() == []


async def test_a_copy_now_job_no_rank_reports_expires_on_the_caches_loop():
    proxy = ProxyCopyEngine(2, num_blocks=8, num_slots=4, report_timeout_s=0.05)  # built on the loop
    done: list = []
    proxy.copy_now(Direction.STORE, np.array([1]), np.array([1]), done.append)
    proxy.take_jobs()
    proxy.report(0, [1])
    await asyncio.sleep(0.2)
    assert len(done) == 1 and isinstance(done[0], TransferError)
