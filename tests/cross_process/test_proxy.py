"""The scheduler side without workers: job ids, completion counting across ranks, timeouts, cancel.

The test plays the workers' part by calling ``report``; test_cross_process_e2e.py runs real worker processes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scheduler_helpers import SHARD, WORLD, next_jobs, scheduler

from tiered_kv.cross_process import LOAD, STORE, ProxyCopyEngine, request_scope
from tiered_kv.errors import TransferError


async def test_a_job_resolves_only_when_every_rank_reported():
    proxy = ProxyCopyEngine(2, num_blocks=8, num_slots=4)
    a = proxy.submit_store([3, 4], [0, 1])
    b = proxy.submit_load([2], [5])
    jobs = proxy.take_jobs()
    assert [(j.job_id, j.direction) for j in jobs] == [(1, STORE), (2, LOAD)]
    assert jobs[0].gpu_ids.tolist() == [3, 4] and jobs[0].cpu_slots.tolist() == [0, 1]
    assert jobs[1].gpu_ids.tolist() == [5] and jobs[1].cpu_slots.tolist() == [2]
    assert proxy.take_jobs() == []
    proxy.report(0, [1, 2])
    await asyncio.sleep(0.01)
    assert not a.done() and not b.done()  # rank 1 has not reported
    proxy.report(0, [1])  # a repeated report counts once
    await asyncio.sleep(0.01)
    assert not a.done()
    proxy.report(1, [2, 1])
    await a
    await b
    assert proxy.inflight == 0


async def test_a_failed_rank_fails_the_job_once_all_ranks_are_done():
    proxy = ProxyCopyEngine(2, num_blocks=8, num_slots=4)
    h = proxy.submit_store([1], [1])
    proxy.take_jobs()
    proxy.report(1, [], [1])
    await asyncio.sleep(0.01)
    assert not h.done()  # rank 0 may still be copying into the slot: not released yet
    proxy.report(0, [1])
    with pytest.raises(TransferError, match=r"failed on rank\(s\) \[1\]"):
        await h


async def test_a_rank_that_never_reports_fails_the_job_after_the_timeout():
    proxy = ProxyCopyEngine(2, num_blocks=8, num_slots=4, report_timeout_s=0.2)
    h = proxy.submit_store([1], [1])
    queued = proxy.submit_store([2], [2])
    await asyncio.sleep(0.3)
    assert not queued.done()  # the timer starts when a job is sent, not when it is queued
    jobs = proxy.take_jobs()
    proxy.report(0, [j.job_id for j in jobs])
    with pytest.raises(TransferError, match=r"rank\(s\) \[1\] did not report within 0.2 s"):
        await asyncio.wait_for(asyncio.shield(h.future), 2)
    with pytest.raises(TransferError):
        await queued
    proxy.report(1, [1, 2])  # late: ignored, nothing breaks
    assert proxy.inflight == 0


async def test_cancel_fails_only_the_requests_unsent_jobs():
    proxy = ProxyCopyEngine(1, num_blocks=8, num_slots=4)
    with request_scope("r1"):
        sent = proxy.submit_store([1], [1])
    proxy.take_jobs()
    with request_scope("r1"):
        unsent = proxy.submit_store([2], [2])
    with request_scope("r2"):
        other = proxy.submit_store([3], [3])
    assert proxy.unfinished("r1") == 2 and proxy.unfinished("r2") == 1
    assert proxy.cancel_request("r1") == 1
    with pytest.raises(TransferError, match="cancelled before it was sent"):
        await asyncio.wait_for(asyncio.shield(unsent.future), 5)
    assert not sent.done() and not other.done()
    assert [j.job_id for j in proxy.take_jobs()] == [3]
    proxy.report(0, [1, 3])
    await sent
    await other
    assert proxy.unfinished("r1") == 0


async def test_ids_are_checked_before_anything_is_queued():
    proxy = ProxyCopyEngine(2, num_blocks=8, num_slots=4)
    with pytest.raises(TransferError, match="cpu slot 4 out of range"):
        proxy.submit_store([1], [4])
    with pytest.raises(TransferError, match="rank 2"):
        proxy.report(2, [1])
    assert proxy.take_jobs() == []


def forget_request(proxy: ProxyCopyEngine, req_id: str) -> None:
    """Drop a cancelled request's tag (what a request gone for good would need; the proxy has no use for it)."""
    with proxy._lock:
        proxy._cancelled.pop(req_id, None)


async def test_a_cancelled_request_never_sends_a_later_job():
    """A store still waiting for room when its request was preempted submits after the cancel: it must fail."""
    proxy = ProxyCopyEngine(1, num_blocks=8, num_slots=4)
    assert proxy.cancel_request("r#1") == 0
    with request_scope("r#1"):
        late = proxy.submit_store([1], [1])
    with pytest.raises(TransferError, match="cancelled request 'r#1' was never sent"):
        await asyncio.wait_for(asyncio.shield(late.future), 5)
    assert proxy.take_jobs() == [] and proxy.inflight == 0
    forget_request(proxy, "r#1")
    with request_scope("r#1"):
        proxy.submit_store([1], [1])
    assert len(proxy.take_jobs()) == 1


# -- through the scheduler-side cache --------------------------------------------------------------
def keys_of(side, n, start=0):
    return side.keyer.keys_for_block_ids(range(start, start + n))


async def test_a_store_counts_only_once_every_rank_reported(tmp_path):
    side = await scheduler(tmp_path)
    cache = side.cache
    assert cache.layout.bytes_per_block == WORLD * SHARD
    assert side.segment_info.shard_bytes == SHARD and side.segment_info.world_size == WORLD
    keys = keys_of(side, 3)
    with request_scope("req-a"):
        store = asyncio.ensure_future(cache.store(keys, [5, 6, 7]))
    (job,) = await next_jobs(side)
    assert job.req_id == "req-a" and job.gpu_ids.tolist() == [5, 6, 7]
    side.proxy.report(1, [job.job_id])
    await asyncio.sleep(0.05)
    hit = cache.lookup(keys)
    assert (hit.cpu, hit.pending) == (0, 3) and not store.done()  # one shard missing: not stored yet
    side.proxy.report(0, [job.job_id])
    assert (await store).stored == 3
    assert cache.lookup(keys).cpu == 3
    load = asyncio.ensure_future(cache.load(keys, [1, 2, 3]))
    (job,) = await next_jobs(side)
    assert job.direction == LOAD and job.cpu_slots.tolist() == sorted(job.cpu_slots.tolist())
    side.proxy.report(0, [job.job_id])
    side.proxy.report(1, [job.job_id])
    assert await load == 3
    await side.aclose()
    assert not (tmp_path / "tkv-eng.kv").exists()


async def test_a_store_a_rank_never_reports_is_discarded_and_its_slots_freed(tmp_path):
    side = await scheduler(tmp_path, timeout=0.2)
    keys = keys_of(side, 2)
    store = asyncio.ensure_future(side.cache.store(keys, [1, 2]))
    (job,) = await next_jobs(side)
    side.proxy.report(0, [job.job_id])
    with pytest.raises(TransferError, match=r"\[1\] did not report"):
        await asyncio.wait_for(store, 10)
    assert side.cache.lookup(keys).total == 0
    assert side.cache.manager.cpu.used == 0
    side.cache.check_invariants()
    await side.aclose()


async def test_a_load_a_rank_failed_raises_and_leaves_the_blocks_resident(tmp_path):
    side = await scheduler(tmp_path)
    keys = keys_of(side, 2)
    store = asyncio.ensure_future(side.cache.store(keys, [1, 2]))
    (job,) = await next_jobs(side)
    side.proxy.report(0, [job.job_id])
    side.proxy.report(1, [job.job_id])
    await store
    load = asyncio.ensure_future(side.cache.load(keys, [3, 4]))
    (job,) = await next_jobs(side)
    side.proxy.report(0, [job.job_id])
    side.proxy.report(1, [], [job.job_id])
    with pytest.raises(TransferError, match="failed on rank"):
        await load
    assert side.cache.lookup(keys).cpu == 2  # the CPU copies are fine; only the GPU side failed
    side.cache.check_invariants()
    await side.aclose()


async def test_cancelling_a_requests_unsent_store_aborts_it_cleanly(tmp_path):
    side = await scheduler(tmp_path)
    keys = keys_of(side, 4)
    with request_scope("gone"):
        store = asyncio.ensure_future(side.cache.store(keys, [1, 2, 3, 4]))
    await asyncio.wait_for(side.jobs_ready.wait(), 5)
    assert side.proxy.unfinished("gone") == 1
    assert side.proxy.cancel_request("gone") == 1
    with pytest.raises(TransferError, match="cancelled before it was sent"):
        await asyncio.wait_for(store, 5)
    assert side.proxy.take_jobs() == []
    assert side.cache.lookup(keys).total == 0 and side.cache.manager.cpu.used == 0
    side.cache.check_invariants()
    await side.aclose()


async def test_the_keys_name_the_whole_tp_group(tmp_path):
    two = await scheduler(tmp_path, engine_id="two")
    one = await scheduler(tmp_path, world=1, engine_id="one")
    assert two.keyer.namespace.shard == "tp-group-of2" and one.keyer.namespace.shard == "tp-group-of1"
    assert keys_of(two, 1) != keys_of(one, 1)
    assert np.array_equal(two.cache.slabs.slab_np.shape, (two.segment_info.num_slots, 2, SHARD))
    await two.aclose()
    await one.aclose()
