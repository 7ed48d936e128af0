"""ProxyCopyEngine: the scheduler's GPU <-> CPU copy engine, whose copies run on every TP rank's worker.

The cache calls ``submit_store`` / ``submit_load`` (on its loop) as it would a local engine; each queues a
ShardJob with the next job id. The connector hands the queued jobs to the workers in the next step's
metadata (``take_jobs``) and feeds their completions back (``report``). A job's handle resolves only
when all ``world_size`` ranks have reported it: ok if every rank copied its shard, TransferError if any
rank failed. So a block counts as stored only once every shard has landed, and a slot is reused only
after every rank has stopped touching it.

A sent job that some rank never reports fails after ``report_timeout_s`` (the store is discarded and
its slots freed, a load becomes a load error). That rank may still copy later: keep the timeout well
above any real copy time; it is there so a dead rank cannot hang the cache, not as flow control.
A job not yet sent can be cancelled per request (``cancel_request``): it resolves failed at once, so
the cache aborts it cleanly, and so does every later job of that request (a store still waiting for
room when its request was preempted must never copy the blocks vLLM has since handed to another).

``take_jobs``, ``report``, ``cancel_request``, ``unfinished`` and ``expire`` are thread-safe (vLLM calls
its scheduler-side connector from the engine's thread); futures are resolved on the cache's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import TransferError
from ..transfer.engines.base import CopyHandle, Direction, check_id_arrays
from .shard_jobs import LOAD, STORE, ShardJob

log = logging.getLogger(__name__)
CANCELLED_TAGS = 1 << 16  # cancelled request tags remembered (oldest forgotten first)
_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("tiered_kv_request", default=None)


@contextlib.contextmanager
def request_scope(req_id: str | None) -> Iterator[None]:
    """Tag the jobs of cache calls started inside this block with ``req_id`` (a contextvar: the
    cache's tasks inherit it), so ``cancel_request`` and ``unfinished`` can find them."""
    token = _REQUEST.set(req_id)
    try:
        yield
    finally:
        _REQUEST.reset(token)


@dataclass(eq=False)
class _Entry:
    job: ShardJob
    future: asyncio.Future[None] | None  # None: ``done`` is called instead (``copy_now``)
    loop: asyncio.AbstractEventLoop | None
    done: Callable[[BaseException | None], None] | None = None
    ranks: set[int] = field(default_factory=set)
    failed: list[int] = field(default_factory=list)
    deadline: float = 0.0


class ProxyCopyEngine:
    """Queues jobs for the workers and resolves them from the ranks' reports (see the module docstring)."""

    copy_path: str | None = None  # the ranks' engines choose theirs (ShardCopier.copy_path); CopyEngine's attribute

    def __init__(self, world_size: int, num_blocks: int, num_slots: int, *, bytes_per_block: int = 0,
                 report_timeout_s: float = 60.0, on_job: Callable[[], None] | None = None) -> None:  # fmt: skip
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise TransferError(f"world_size must be an int >= 1, got {world_size!r}")
        if not report_timeout_s > 0:
            raise TransferError(f"report_timeout_s must be positive, got {report_timeout_s!r}")
        self.world_size = world_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        self.report_timeout_s = float(report_timeout_s)
        self._on_job = on_job
        self._lock = threading.Lock()
        self._queued: dict[int, _Entry] = {}  # insertion order = submission order
        self._sent: dict[int, _Entry] = {}
        self._next_id = 1
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        self._close_task: asyncio.Future[None] | None = None
        try:  # the cache's loop (built there): the report timers of ``copy_now`` jobs run on it
            self._home: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._home = None

    # -- the cache's side (on its loop) ----------------------------------------------------
    # ``compute`` (the engine interface's compute event) orders nothing here: each worker records its own,
    # in its model runner's thread, when it issues the job.
    def submit_store(self, gpu_ids: Sequence[int] | np.ndarray, cpu_slots: Sequence[int] | np.ndarray, *,
                     compute: object = None) -> CopyHandle:  # fmt: skip
        src, dst = check_id_arrays(gpu_ids, cpu_slots, src_len=self.num_blocks, dst_len=self.num_slots,
                                   src_name="gpu block id", dst_name="cpu slot")  # fmt: skip
        return self._submit(STORE, src, dst)

    def submit_load(self, cpu_slots: Sequence[int] | np.ndarray, gpu_ids: Sequence[int] | np.ndarray, *,
                    compute: object = None) -> CopyHandle:  # fmt: skip
        src, dst = check_id_arrays(cpu_slots, gpu_ids, src_len=self.num_slots, dst_len=self.num_blocks,
                                   src_name="cpu slot", dst_name="gpu block id")  # fmt: skip
        return self._submit(LOAD, dst, src)

    def _submit(self, direction: str, gpu_ids: np.ndarray, cpu_slots: np.ndarray) -> CopyHandle:
        if self._closed:
            raise TransferError(f"submit_{direction} on a closed ProxyCopyEngine")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        req_id = _REQUEST.get()
        with self._lock:
            job = ShardJob(self._next_id, direction, gpu_ids, cpu_slots, req_id)
            self._next_id += 1
            cancelled = req_id is not None and req_id in self._cancelled
            if not cancelled:
                self._queued[job.job_id] = _Entry(job, future, loop)
        if cancelled:
            future.set_exception(TransferError(f"job {job.job_id} ({direction} of {len(job)} blocks) of "
                                               f"cancelled request {req_id!r} was never sent"))  # fmt: skip
        elif self._on_job is not None:
            self._on_job()
        kind = Direction.STORE if direction == STORE else Direction.LOAD
        return CopyHandle(future, len(gpu_ids) * self.bytes_per_block, kind)

    def copy_now(self, direction: Direction, src_ids: np.ndarray, dst_ids: np.ndarray,
                 done: Callable[[BaseException | None], None]) -> None:  # fmt: skip
        """Queue a job with no asyncio future (from any thread, the caller holding the cache's state lock):
        ``done(error)`` is called once every rank reported it (in ``report``'s thread), or it failed
        (cancelled, expired, abandoned: in that call's thread). The dispatcher's threaded start for a
        caller that plans in its own thread (the scheduler's hooks)."""
        if self._closed:
            raise TransferError("copy_now on a closed ProxyCopyEngine")
        if direction == Direction.STORE:
            gpu, cpu = check_id_arrays(src_ids, dst_ids, src_len=self.num_blocks, dst_len=self.num_slots,
                                       src_name="gpu block id", dst_name="cpu slot")  # fmt: skip
        else:
            cpu, gpu = check_id_arrays(src_ids, dst_ids, src_len=self.num_slots, dst_len=self.num_blocks,
                                       src_name="cpu slot", dst_name="gpu block id")  # fmt: skip
        req_id = _REQUEST.get()
        kind = STORE if direction == Direction.STORE else LOAD
        with self._lock:
            job = ShardJob(self._next_id, kind, gpu, cpu, req_id)
            self._next_id += 1
            cancelled = req_id is not None and req_id in self._cancelled
            entry = _Entry(job, None, self._home, done)
            if not cancelled:
                self._queued[job.job_id] = entry
        if cancelled:
            _settle(entry, f"job {job.job_id} ({kind} of {len(job)} blocks) of cancelled request {req_id!r} "
                           "was never sent")  # fmt: skip
        elif self._on_job is not None:
            self._on_job()

    @property
    def inflight(self) -> int:
        """Jobs queued or sent and not yet resolved."""
        with self._lock:
            return len(self._queued) + len(self._sent)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the connector's side (any thread) -------------------------------------------------
    def take_jobs(self) -> list[ShardJob]:
        """Every job queued since the last call, in submission order; their report timers start now."""
        with self._lock:
            if not self._queued:
                return []
            entries = list(self._queued.values())
            self._queued.clear()
            deadline = time.monotonic() + self.report_timeout_s
            for e in entries:
                e.deadline = deadline
                self._sent[e.job.job_id] = e
        loops = {e.loop for e in entries if e.loop is not None}
        for loop in loops:  # one timer per batch: a rank that never reports cannot hang the cache
            _call_soon(loop, loop.call_later, self.report_timeout_s + 0.01, self.expire)
        return [e.job for e in entries]

    def report(self, rank: int, done_ok: Iterable[int], done_failed: Iterable[int] = ()) -> None:
        """Rank ``rank`` finished these jobs; a job resolves once all ranks have reported it."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TransferError(f"report from rank {rank!r}, outside [0, {self.world_size})")
        done: list[tuple[_Entry, str | None]] = []
        with self._lock:
            for ids, ok in ((done_ok, True), (done_failed, False)):
                for job_id in ids:
                    e = self._sent.get(int(job_id))
                    if e is None:
                        log.warning("tiered_kv: rank %d reported job %s, which is not in flight (expired, or "
                                    "never sent); ignored", rank, job_id)  # fmt: skip
                        continue
                    if rank in e.ranks:
                        continue  # a repeated report changes nothing
                    e.ranks.add(rank)
                    if not ok:
                        e.failed.append(rank)
                    if len(e.ranks) == self.world_size:
                        del self._sent[e.job.job_id]
                        done.append((e, _failure(e) if e.failed else None))
        for e, why in done:
            _settle(e, why)

    def cancel_request(self, req_id: str) -> int:
        """Fail the request's jobs not yet sent, and any it submits later (the cache aborts them);
        sent jobs finish normally. Returns how many queued jobs it failed."""
        with self._lock:
            self._refuse_later(req_id)
            gone = [e for e in self._queued.values() if e.job.req_id == req_id]
            for e in gone:
                del self._queued[e.job.job_id]
        for e in gone:
            _settle(e, f"job {e.job.job_id} ({e.job.direction} of {len(e.job)} blocks) was cancelled before it "
                       f"was sent: request {req_id!r} was preempted or finished")  # fmt: skip
        return len(gone)

    def _refuse_later(self, req_id: str) -> None:
        """(under the lock) Jobs the request submits from now on fail at submit (oldest tags forgotten)."""
        self._cancelled[req_id] = None
        self._cancelled.move_to_end(req_id)
        while len(self._cancelled) > CANCELLED_TAGS:
            self._cancelled.popitem(last=False)

    def seal_request(self, req_id: str) -> None:
        """Refuse the request's later jobs (they fail at submit, as after ``cancel_request``) but keep its
        queued ones: a synchronous load whose first job rides in this step's metadata may plan no more."""
        with self._lock:
            self._refuse_later(req_id)

    def queued_blocks(self, req_id: str) -> int:
        """Blocks in the request's jobs queued and not yet taken by ``take_jobs``."""
        with self._lock:
            return sum(len(e.job) for e in self._queued.values() if e.job.req_id == req_id)

    def sent_jobs(self, req_id: str, direction: str | None = None) -> list[int]:
        """Ids of the request's jobs sent to the workers and not yet resolved (e.g. for a fence)."""
        with self._lock:
            return [e.job.job_id for e in self._sent.values()
                    if e.job.req_id == req_id and (direction is None or e.job.direction == direction)]  # fmt: skip

    def abandon(self, why: str) -> int:
        """Fail every queued and sent job at once (the workers are gone, e.g. at engine shutdown);
        returns how many. Only for a cache that is closing: a worker still alive could write late."""
        with self._lock:
            gone = [*self._queued.values(), *self._sent.values()]
            self._queued.clear()
            self._sent.clear()
        for e in gone:
            _settle(e, f"job {e.job.job_id} ({e.job.direction} of {len(e.job)} blocks) abandoned: {why}")
        return len(gone)

    def unfinished(self, req_id: str) -> int:
        """Jobs of the request queued or sent and not yet resolved (e.g. for delayed freeing)."""
        with self._lock:
            return sum(e.job.req_id == req_id for d in (self._queued, self._sent) for e in d.values())

    def expire(self, now: float | None = None) -> list[int]:
        """Fail every sent job whose ranks have not all reported by its deadline; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [e for e in self._sent.values() if e.deadline <= now]
            for e in late:
                del self._sent[e.job.job_id]
        for e in late:
            missing = sorted(set(range(self.world_size)) - e.ranks)
            _settle(e, f"job {e.job.job_id} ({e.job.direction} of {len(e.job)} blocks): rank(s) {missing} did "
                       f"not report within {self.report_timeout_s} s")  # fmt: skip
        return [e.job.job_id for e in late]

    # -- closing ----------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Fail every unsent job, then wait for the sent ones (reported or expired). Idempotent."""
        self._closed = True
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._drain())
        await asyncio.shield(self._close_task)

    async def _drain(self) -> None:
        with self._lock:
            unsent = list(self._queued.values())
            self._queued.clear()
        for e in unsent:
            _settle(e, f"job {e.job.job_id} was never sent: the cache closed")
        while True:
            with self._lock:
                futures = [e.future for e in self._sent.values() if e.future is not None]
                others = len(self._sent) - len(futures)  # copy_now jobs: their reports come from another thread
            if not futures and not others:
                return
            if others:
                await asyncio.sleep(0.01)
            else:
                await asyncio.wait(futures, timeout=self.report_timeout_s + 0.05)
            self.expire()


def _failure(e: _Entry) -> str:
    return (f"job {e.job.job_id} ({e.job.direction} of {len(e.job)} blocks) failed on rank(s) "
            f"{sorted(e.failed)}")  # fmt: skip


def _settle(e: _Entry, why: str | None) -> None:
    """Resolve an entry's future on its own loop (we may be on another thread); a ``copy_now`` job's
    ``done`` is called here and now."""
    if e.done is None:
        _call_soon(e.loop, _resolve, e.future, why)
        return
    try:
        e.done(None if why is None else TransferError(why))
    except Exception:
        log.exception("tiered_kv: finishing job %d failed", e.job.job_id)


def _resolve(future: asyncio.Future[None], why: str | None) -> None:
    if future.done():
        return
    if why is None:
        future.set_result(None)
    else:
        future.set_exception(TransferError(why))


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody waits for these futures any more
        log.debug("tiered_kv: loop closed before %s could run", getattr(fn, "__name__", fn))
