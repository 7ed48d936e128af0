"""RemoteStore: batches of blocks between the CPU tier's slab rows and Redis, verified, never raising for faults.

``put`` / ``get`` / ``exists`` each make one pipelined round trip per server. Faults of the server
(down, restarted, paused past the timeout, out of memory) never raise: the batch answers False,
the tier turns ``degraded`` (one WARNING, ``tiered_kv_degraded_events_total{remote}``), every call
answers False at once without touching the network, and a background task probes the server with
capped, jittered exponential backoff and clears ``degraded`` when it answers again. Blocks a batch
finished before a fault keep their True. Hashing and copying of large batches run on the store's own
threads, so the event loop keeps serving; a cancelled ``get`` waits for copies already running
before it re-raises, so no slot row is written after the call has returned.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ...errors import KeyFormatError, RemoteError, SlotError, TieredKVError
from ...metrics import CacheMetrics
from ...tier_config import RemoteTierConfig
from ..cpu import CpuSlabs
from ..slab_parts import SlabParts, xxh_parts
from .client import Connections, Node, OutOfMemoryError, Reply, ResponseError, read_password
from .format import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    check_values,
    encode_headers,
    namespace_digest,
    redis_keys,
    row_sums,
)

log = logging.getLogger("tiered_kv.remote")

INLINE_BYTES = 1 << 20  # batches below this hash and copy on the loop: a thread hand-off costs more
CHUNK_BYTES = 4 << 20  # get: verify and land replies in chunks of this size while later ones arrive
BACKOFF_FIRST, BACKOFF_CAP = 0.05, 5.0  # seconds between reconnect probes: doubling, capped, jittered


class RemoteStore:
    """One namespace of blocks in Redis; ``degraded`` is True while the server is unreachable."""

    def __init__(self, cfg: RemoteTierConfig, namespace: str, slabs: CpuSlabs, metrics: CacheMetrics,
                 conns: Connections) -> None:  # fmt: skip
        if not namespace or len(namespace) > 200 or any(c.isspace() or not c.isprintable() for c in namespace):
            raise TieredKVError(f"remote namespace must be 1-200 printable characters without spaces, got {namespace!r}")
        self.cfg, self.namespace, self._conns, self._m = cfg, namespace, conns, metrics
        self._slab = slabs.slab_np
        self._bpb = slabs.bytes_per_block
        self._prefix = (cfg.key_prefix + namespace + ":").encode()
        self._nsd = namespace_digest(namespace)
        expiry = b"" if not cfg.ttl else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(cfg.ttl)), cfg.ttl)
        self._set_head = b"*5\r\n$3\r\nSET\r\n" if cfg.ttl else b"*3\r\n$3\r\nSET\r\n"
        self._set_tail = b"\r\n" + expiry
        self._vlen = b"$%d\r\n" % (HEADER_SIZE + self._bpb)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tkv-remote")
        self.degraded = False
        self.degraded_reason = ""
        self._warned = False
        self._recovery: asyncio.Task | None = None
        self._refreshing: asyncio.Task | None = None
        self._closed = False

    @classmethod
    async def open(cls, cfg: RemoteTierConfig, namespace: str, slabs: CpuSlabs, metrics: CacheMetrics) -> RemoteStore:
        """Connect and PING within ``cfg.timeout``; RemoteError naming the URL (no password) when unreachable."""
        conns = Connections(cfg, read_password(cfg))
        try:
            store = cls(cfg, namespace, slabs, metrics, conns)
        except BaseException:
            await conns.aclose()
            raise
        try:
            await asyncio.wait_for(store._probe(), cfg.timeout)
        except Exception as e:
            await store.aclose()
            why = f"no answer within tiers.remote.timeout = {cfg.timeout} s" if isinstance(e, TimeoutError) else str(e)
            raise RemoteError(f"tiers.remote: cannot reach {conns.where}: {why}") from None
        return store

    # ---- the three batch operations ------------------------------------------------------------------
    async def exists(self, keys: np.ndarray) -> np.ndarray:
        """bool[n]: which keys Redis holds now (not verified: a later ``get`` still may miss)."""
        keys = self._check_keys(keys)
        out = np.zeros(len(keys), dtype=bool)
        if not len(keys) or self.degraded:
            self._count("exists", "failed", len(keys) if self.degraded else 0)
            return out
        rkeys = redis_keys(self._prefix, keys)

        def chunks(idx: list[int]) -> list:
            return [b"".join(b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(rkeys[i]), rkeys[i]) for i in idx)]

        def on_reply(idx: list[int]) -> Callable[[int, Reply], None]:
            def take(j: int, reply: Reply) -> None:
                out[idx[j]] = reply == 1
            return take

        done = await self._batch("exists", rkeys, chunks, on_reply)
        present = int(np.count_nonzero(out))
        self._count("exists", "present", present)
        self._count("exists", "absent", int(np.count_nonzero(done)) - present)
        self._count("exists", "failed", len(keys) - int(np.count_nonzero(done)))
        return out

    async def put(self, keys: np.ndarray, cpu_slots: np.ndarray) -> np.ndarray:
        """bool[n]: blocks now in Redis, each from its slab row (rows are read, never written)."""
        keys, slots = self._check_keys(keys), self._check_slots(cpu_slots, len(keys))
        n = len(slots)
        ok = np.zeros(n, dtype=bool)
        if not n or self.degraded:
            self._count("put", "failed", n if self.degraded else 0)
            return ok
        t0 = time.perf_counter()  # not loop.time(): uvloop's ticks in whole milliseconds
        parts = SlabParts(self._slab)  # a rank-major segment: a block is its ranks' pieces, sent in rank order
        rows = [parts.views(s) for s in slots.tolist()]
        if len(parts) == 1:
            psums = await self._cpu(n * self._bpb, row_sums, [r[0] for r in rows])
        else:
            psums = await self._cpu(n * self._bpb, _part_sums, rows)
        heads = encode_headers(keys, self._nsd, self._bpb, psums).tobytes()
        rkeys = redis_keys(self._prefix, keys)
        head, tail, vlen, hs = self._set_head, self._set_tail, self._vlen, HEADER_SIZE

        def chunks(idx: list[int]) -> list:
            out, carry = [], b""
            for i in idx:  # [command, key, value length, header] then the row itself: no copy of the row here
                k = rkeys[i]
                out.append(b"".join((carry, head, b"$%d\r\n" % len(k), k, b"\r\n", vlen, heads[i * hs : (i + 1) * hs])))
                out.extend(rows[i])
                carry = tail
            out.append(carry)
            return out

        def on_reply(idx: list[int]) -> Callable[[int, Reply], None]:
            def take(j: int, reply: Reply) -> None:
                ok[idx[j]] = reply == b"OK"
                if isinstance(reply, ResponseError):
                    self._on_error_reply(reply)
            return take

        await self._batch("put", rkeys, chunks, on_reply)
        written = int(np.count_nonzero(ok))
        self._count("put", "stored", written)
        self._count("put", "failed", n - written)
        self._moved("put", written, time.perf_counter() - t0)
        return ok

    async def get(self, keys: np.ndarray, cpu_slots: np.ndarray) -> np.ndarray:
        """bool[n]: blocks verified and written into their slab rows; a False row's content is unspecified."""
        return (await self.get_answered(keys, cpu_slots))[0]

    async def get_answered(self, keys: np.ndarray, cpu_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``get``, plus which keys the server answered: answered and not ok means gone or corrupt
        (forget it), not answered means a fault (it may still be there)."""
        keys, slots = self._check_keys(keys), self._check_slots(cpu_slots, len(keys))
        n = len(slots)
        ok = np.zeros(n, dtype=bool)
        if not n or self.degraded:
            self._count("get", "failed", n if self.degraded else 0)
            return ok, ok.copy()
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()  # not loop.time(): uvloop's ticks in whole milliseconds
        rkeys = redis_keys(self._prefix, keys)
        values: list[Any] = [None] * n
        answered = np.zeros(n, dtype=bool)
        landing: list[asyncio.Future] = []  # verify + copy jobs already handed to the threads
        pending: list[int] = []
        pending_bytes = [0]
        big = n * self._bpb >= INLINE_BYTES

        def land(idx: list[int]) -> None:
            sel = np.asarray(idx, dtype=np.int64)
            if big:
                landing.append(loop.run_in_executor(self._pool, self._land, sel, values, keys, slots, ok))
            else:
                self._land(sel, values, keys, slots, ok)

        def chunks(idx: list[int]) -> list:
            return [b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(rkeys[i]), rkeys[i]) for i in idx)]

        def on_reply(idx: list[int]) -> Callable[[int, Reply], None]:
            def take(j: int, reply: Reply) -> None:
                i = idx[j]
                answered[i] = True
                if isinstance(reply, bytes):
                    values[i] = reply
                    pending.append(i)
                    pending_bytes[0] += len(reply)
                    if pending_bytes[0] >= CHUNK_BYTES:
                        land(pending[:])
                        pending.clear()
                        pending_bytes[0] = 0
                elif isinstance(reply, ResponseError):
                    values[i] = reply  # e.g. WRONGTYPE: not our value; counted as corrupt below
                    self._on_error_reply(reply)
            return take

        try:
            await self._batch("get", rkeys, chunks, on_reply)
            if pending:
                land(pending[:])
        finally:  # cancelled or not: no copy into a slot row may outlive this call
            await _wait_all(landing)
        for fut in landing:  # a job that raised leaves its blocks False; say why once
            if fut.exception() is not None:
                self._m.drop("remote", "land_failed", 1, repr(fut.exception()))
        hits = int(np.count_nonzero(ok))
        gone = int(np.count_nonzero(answered & np.fromiter((v is None for v in values), bool, n)))
        corrupt = int(np.count_nonzero(answered)) - hits - gone
        self._count("get", "hit", hits)
        self._count("get", "miss", gone)
        self._count("get", "failed", n - int(np.count_nonzero(answered)))
        if corrupt:
            self._count("get", "corrupt", corrupt)
            self._m.corrupted["remote"].inc(corrupt)
            self._m.drop("remote", "failed_verification", corrupt)
        self._moved("get", hits, time.perf_counter() - t0)
        return ok, answered

    def _land(self, sel: np.ndarray, values: list, keys: np.ndarray, slots: np.ndarray, ok: np.ndarray) -> None:
        """Verify replies ``sel`` and copy the good payloads into their slab rows (on a thread or inline)."""
        vals = [values[i] for i in sel.tolist()]
        good = check_values(vals, keys[sel], self._nsd, self._bpb)
        block = self._slab.shape[1:]  # (bytes_per_block,), or (ranks, shard) for the rank-major segment
        for j in np.flatnonzero(good).tolist():
            self._slab[slots[sel[j]]] = np.frombuffer(vals[j], np.uint8, self._bpb, HEADER_SIZE).reshape(block)
        ok[sel] = good
        for i in sel[good].tolist():
            values[i] = b""  # landed: free the reply now; b"" (not None) so it is not counted as gone

    # ---- plumbing ------------------------------------------------------------------------------------
    async def _batch(self, op: str, rkeys: list[bytes], chunks: Callable, on_reply: Callable) -> np.ndarray:
        """Run one round trip per server; a fault degrades the tier. Returns which keys had a reply."""
        done = np.zeros(len(rkeys), dtype=bool)

        async def trip(node: Node, idx: list[int]) -> None:
            take = on_reply(idx)

            def mark(j: int, reply: Reply) -> None:
                done[idx[j]] = True
                take(j, reply)

            await node.round_trip(chunks(idx), len(idx), mark)

        try:
            groups = self._conns.split(rkeys)
        except Exception as e:  # a cluster slot no node covers (mid-failover)
            self._degrade(f"{op}: {e}")
            return done
        errors = await _run_all([trip(node, idx) for node, idx in groups])
        if errors:
            self._degrade(f"{op}: {type(errors[0]).__name__}: {errors[0]}")
        return done

    async def _cpu(self, nbytes: int, fn: Callable, *args: Any) -> Any:
        if nbytes < INLINE_BYTES:
            return fn(*args)
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        await _wait_all([fut])  # a cancel waits for the hashing to finish reading the rows
        return fut.result()

    def _on_error_reply(self, reply: ResponseError) -> None:
        if isinstance(reply, OutOfMemoryError):
            self._degrade(f"out of memory: {reply}")
        elif self.cfg.cluster and (self._refreshing is None or self._refreshing.done()):
            # MOVED / ASK / TRYAGAIN / CLUSTERDOWN: the slot map changed; reload it in the background
            self._refreshing = asyncio.get_running_loop().create_task(self._quiet(self._conns.refresh()))

    def _degrade(self, reason: str) -> None:
        if self.degraded or self._closed:
            return
        self.degraded, self.degraded_reason = True, reason
        self._m.degrade["remote"].inc()
        how = log.warning if not self._warned else log.info
        self._warned = True
        how("remote tier %s degraded (serving from GPU, CPU and disk; reconnecting in the background): %s",
            self._conns.where, reason)  # fmt: skip
        self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        delay = BACKOFF_FIRST
        while not self._closed:
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            try:
                await self._quiet(self._conns.refresh(), swallow=False)
                await asyncio.wait_for(self._probe(), self.cfg.timeout)
            except Exception:
                delay = min(delay * 2, BACKOFF_CAP)
                continue
            self.degraded, self.degraded_reason = False, ""
            log.info("remote tier %s recovered", self._conns.where)
            return

    async def _probe(self) -> None:
        """PING every server; on a single node also a small expiring SET (fails while Redis is out of memory)."""
        await self._conns.start()
        probe = self._prefix + b"probe"
        for node in self._conns.nodes():
            cmd = b"*1\r\n$4\r\nPING\r\n"
            count = 1
            if not self.cfg.cluster:
                cmd += b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\n1\r\n$2\r\nPX\r\n$4\r\n1000\r\n" % (len(probe), probe)
                count = 2
            replies: list[Reply] = []
            await node.round_trip([cmd], count, lambda _j, r, out=replies: out.append(r))
            bad = next((r for r in replies if isinstance(r, ResponseError)), None)
            if bad is not None:
                raise RemoteError(f"{node.name} answered {bad}")

    async def _quiet(self, coro: Any, swallow: bool = True) -> None:
        try:
            await asyncio.wait_for(coro, self.cfg.timeout)
        except Exception:
            if not swallow:
                raise

    def _count(self, op: str, result: str, n: int) -> None:
        if n:
            self._m.remote_blocks.labels(op, result).inc(n)

    def _moved(self, op: str, blocks: int, seconds: float) -> None:
        self._m.remote_bytes.labels(op).inc(blocks * (HEADER_SIZE + self._bpb))
        self._m.remote_seconds.labels(op).inc(seconds)

    def _check_keys(self, keys: np.ndarray) -> np.ndarray:
        if not isinstance(keys, np.ndarray) or keys.dtype != np.uint8 or keys.ndim != 2 or not 8 <= keys.shape[1] <= MAX_KEY_BYTES:
            what = f"{keys.dtype}{list(keys.shape)}" if isinstance(keys, np.ndarray) else type(keys).__name__
            raise KeyFormatError(f"remote keys must be uint8[n, 8..{MAX_KEY_BYTES}], got {what}")
        return keys

    def _check_slots(self, cpu_slots: np.ndarray, n: int) -> np.ndarray:
        s = np.asarray(cpu_slots)
        if s.ndim != 1 or len(s) != n or (s.size and s.dtype.kind not in "iu"):
            raise SlotError(f"remote cpu_slots must be {n} integers, got {s.dtype}{list(s.shape)}")
        if s.size and (s.min() < 0 or s.max() >= len(self._slab)):
            raise SlotError(f"remote cpu_slots must be in [0, {len(self._slab)}), got {int(s.min())}..{int(s.max())}")
        return s.astype(np.int64, copy=False)

    async def aclose(self) -> None:
        self._closed = True
        for task in (self._recovery, self._refreshing):
            if task is not None and not task.done():
                task.cancel()
                await _wait_all([task])
        await self._conns.aclose()
        self._pool.shutdown(wait=False)


async def _wait_all(futs: list) -> None:
    """Wait until every future is done, even if this task is cancelled meanwhile (re-raised after)."""
    cancelled = False
    pending = [f for f in futs if not f.done()]
    while pending:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
        pending = [f for f in pending if not f.done()]
    for f in futs:  # retrieve results so no "exception was never retrieved" noise
        if not f.cancelled():
            f.exception()
    if cancelled:
        raise asyncio.CancelledError


async def _run_all(coros: list) -> list[BaseException]:
    """Run round trips concurrently; their faults as a list. Cancelled: cancel them all, wait, re-raise."""
    if len(coros) == 1:  # the single-node case: no task to create
        try:
            await coros[0]
        except Exception as e:
            return [e]
        return []
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await _wait_all(tasks)
        raise
    return [t.exception() for t in tasks if t.exception() is not None]


def _part_sums(rows: list[list[memoryview]]) -> np.ndarray:
    """xxh3-64 of each block given as its pieces in rank order (the digest of the whole record payload)."""
    return np.fromiter((xxh_parts(r) for r in rows), dtype=np.uint64, count=len(rows))
