"""The cache across processes without vLLM: a scheduler-side cache on the proxy engine and two real worker processes.

Each worker holds real KV tensors and copies only its shard of each slot of the shared segment; the
test's pump plays the connector (jobs out each "step", completions back through ``report`` from a
reader thread, as vLLM's scheduler thread would).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import threading

import numpy as np
import pytest
from copier_proc import pattern, run
from scheduler_helpers import SHARD, WORLD, config, shard_layout
from slab_blocks import read_blocks

from tiered_kv.cross_process import open_scheduler_cache, request_scope
from tiered_kv.errors import TransferError

ENGINE = "e2e"


class Worker:
    def __init__(self, ctx, cfg, rank: int, world: int) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run, args=(child, cfg, rank, world, ENGINE), daemon=True)
        self.proc.start()
        self.replies: queue.Queue = queue.Queue()
        self.proxy = None
        self._held: list = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "done":
                if self.proxy is None:
                    self._held.append(msg)
                else:
                    self.proxy.report(self.rank, msg[1], msg[2])  # thread-safe, as from vLLM's thread
            else:
                self.replies.put(msg)

    def ask(self, *msg, timeout: float = 120.0):
        self.conn.send(msg)
        return self.replies.get(timeout=timeout) if msg[0] in ("fill", "check") else None

    def reply(self, timeout: float = 180.0):
        return self.replies.get(timeout=timeout)


class Pump:
    """The connector's step loop: take the queued jobs, send them to every rank."""

    def __init__(self, side, workers) -> None:
        self.side, self.workers = side, workers
        self.paused = False
        self.sent: list = []
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            if not self.paused:
                jobs = self.side.proxy.take_jobs()
                if jobs:
                    self.sent += jobs
                    for w in self.workers:
                        w.conn.send(("jobs", jobs))
            await asyncio.sleep(0.003)


async def check(workers, expect: dict) -> None:
    """Every rank's GPU block g holds its shard of pattern(block, gen)."""
    loop = asyncio.get_running_loop()
    for w in workers:
        reply = await loop.run_in_executor(None, w.ask, "check", expect)
        assert reply[0] == "checked" and reply[1] == [], f"rank {w.rank}: wrong bytes in GPU blocks {reply[1]}"


@pytest.fixture(params=[WORLD, 4], ids=lambda w: f"tp{w}")
def workers(tmp_path, request):
    world = request.param
    cfg = config(tmp_path, cpu_blocks=4, disk_blocks=64, world=world)
    ctx = mp.get_context("spawn")
    ws = [Worker(ctx, cfg, r, world) for r in range(world)]
    yield cfg, ws
    for w in ws:
        try:
            w.conn.send(("exit",))
        except OSError:
            pass
    for w in ws:
        w.proc.join(30)
        if w.proc.is_alive():
            w.proc.kill()


async def test_every_rank_round_trips_through_cpu_and_disk(workers, tmp_path):
    """TP=2 and TP=4 with the host engine: real worker processes, each copying only its own sub-slab."""
    cfg, ws = workers
    world = len(ws)
    loop = asyncio.get_running_loop()
    infos = [await loop.run_in_executor(None, w.reply) for w in ws]  # the workers open the segment first
    assert [i[0] for i in infos] == ["ready"] * world and all(i[1] == infos[0][1] for i in infos)
    side = await open_scheduler_cache(cfg, shard_layout(), world_size=world, engine_id=ENGINE, report_timeout_s=60.0)
    assert side.segment_info == infos[0][1]  # scheduler and ranks computed the same segment independently
    side.segment_mapped_by_all()  # as the connector does once the workers' handshake arrived
    assert not (tmp_path / "tkv-e2e.kv").exists() and (tmp_path / "tkv-e2e.live").exists()
    for w in ws:
        w.proxy = side.proxy
    pump = Pump(side, ws)
    cache, keyer = side.cache, side.keyer
    try:
        for w in ws:
            assert (await loop.run_in_executor(None, w.ask, "fill", 1))[0] == "filled"

        # 1. store then load, byte-exact per shard; a slot's block is rank 0's shard, then rank 1's, ...
        keys = keyer.keys_for_block_ids(range(3))
        assert (await cache.store(keys, [10, 11, 12])).stored == 3
        (job,) = pump.sent
        rows = read_blocks(cache.slabs, job.cpu_slots)
        for i, g in enumerate([10, 11, 12]):
            assert np.array_equal(rows[i], np.concatenate([pattern(r, g, 1) for r in range(world)]))
        assert await cache.load(keys, [30, 31, 32]) == 3
        await check(ws, {30: (10, 1), 31: (11, 1), 32: (12, 1)})

        # 2. a block counts as stored only when every rank's shard has landed
        ws[1].ask("mute", True)
        more = keyer.keys_for_block_ids(range(3, 5))
        store = asyncio.ensure_future(cache.store(more, [13, 14]))
        await asyncio.sleep(0.5)
        hit = cache.lookup(more)
        assert not store.done() and hit.cpu == 0 and hit.pending == 2
        ws[1].ask("mute", False)
        assert (await store).stored == 2
        assert cache.lookup(more).cpu == 2

        # 3. spill to disk and promote back: 12 blocks through a 4-slot CPU tier, whole rows on disk
        many = keyer.keys_for_block_ids(range(100, 112))
        for a in range(0, 12, 4):
            assert (await cache.store(many[a : a + 4], list(range(40 + a, 44 + a)))).stored == 4
        await asyncio.sleep(0.2)
        hit = cache.lookup(many)
        assert hit.disk >= 8, hit
        got = 0
        while got < 12:  # a load promotes through the 4 CPU slots in chunks
            n = await cache.load(many[got:], list(range(got, 12)))
            assert n > 0
            got += n
        await check(ws, {i: (40 + i, 1) for i in range(12)})

        # 4. a rank that never reports: the store fails after the timeout, its slots are freed
        side.proxy.report_timeout_s = 3.0  # short for this step only: a loaded CI box may take seconds per job
        ws[0].ask("mute", True)
        lost = keyer.keys_for_block_ids(range(200, 202))
        with pytest.raises(TransferError, match=r"rank\(s\) \[0\] did not report within 3.0 s"):
            await asyncio.wait_for(cache.store(lost, [20, 21]), 30)
        assert cache.lookup(lost).total == 0
        cache.check_invariants()
        ws[0].ask("mute", False)  # its late reports are ignored
        side.proxy.report_timeout_s = 60.0

        # 5. a request's unsent job is cancelled: it fails, and no rank ever sees it
        pump.paused = True
        n_sent = len(pump.sent)
        gone = keyer.keys_for_block_ids(range(300, 302))
        with request_scope("req-gone"):
            store = asyncio.ensure_future(cache.store(gone, [22, 23]))
        while side.proxy.unfinished("req-gone") == 0:
            await asyncio.sleep(0.005)
        assert side.proxy.cancel_request("req-gone") == 1
        with pytest.raises(TransferError, match="cancelled before it was sent"):
            await asyncio.wait_for(store, 10)
        pump.paused = False
        assert len(pump.sent) == n_sent and cache.lookup(gone).total == 0
        reply = await loop.run_in_executor(None, ws[1].ask, "check", {})
        assert reply[2] == n_sent  # jobs that rank has seen: none of the cancelled one

        # 6. what was stored before all this still loads byte-exact on both ranks
        for w in ws:
            assert (await loop.run_in_executor(None, w.ask, "fill", 2))[0] == "filled"
        assert await cache.load(keys, [50, 51, 52]) == 3
        await check(ws, {50: (10, 1), 51: (11, 1), 52: (12, 1)})
        cache.check_invariants()
        assert side.segment_info.row_bytes == world * SHARD
    finally:
        pump.task.cancel()
        await side.aclose()
    for w in ws:
        w.conn.send(("exit",))
    for w in ws:
        w.proc.join(30)
    assert not list(tmp_path.glob("tkv-e2e.*"))  # a normal stop leaves nothing in the segment directory
