"""LoopThread.call on a timeout: the call is cancelled, and it returns only after its copies landed.

The connector's scheduler half calls its cache from vLLM's thread through a LoopThread (tiered_kv.loops);
this runs without vLLM, a TieredKVCache on such a thread. The copy engine is a real HostCopyEngine
whose worker thread sleeps before each batch, so a call can time out while its copy is still queued;
the cache's contract must then hold across threads: vLLM reuses its blocks the moment ``call``
returns, so no copy may touch them after.
"""

from __future__ import annotations

import time

import pytest
import torch
from loop_cache import CacheThread

import tiered_kv as tkv
import tiered_kv.cache
from tiered_kv.transfer import HostCopyEngine

NUM_BLOCKS, WIDTH = 16, 2048


class SlowHostEngine(HostCopyEngine):
    """Every batch goes to the worker thread, which sleeps ``delay`` seconds, then copies."""

    def __init__(self, gpu, cpu) -> None:
        super().__init__(gpu, cpu, inline_bytes=0)
        self.delay = 0.0
        self.submitted = 0
        self.copied_at: list[float] = []  # when each batch's bytes had all landed

    def _launch(self, *args) -> None:
        self.submitted += 1
        super()._launch(*args)

    def _threaded(self, job, handle, loop) -> None:
        time.sleep(self.delay)
        super()._threaded(job, handle, loop)  # copies, then tells the loop

    def _resolve_threaded(self, handle, error) -> None:  # on the loop, once the batch's bytes landed
        self.copied_at.append(time.monotonic())
        super()._resolve_threaded(handle, error)


def check_copies_landed(engine: SlowHostEngine, before: int, returned: float) -> None:
    assert engine.submitted > before, "test setup: the call timed out before it queued its copy"
    assert len(engine.copied_at) == engine.submitted, "call returned while its copy was still queued"
    assert engine.copied_at[-1] <= returned


@pytest.fixture
def runtime(monkeypatch):
    engines: list[SlowHostEngine] = []

    def make(kind, gpu, cpu, **kw):
        engines.append(SlowHostEngine(gpu, cpu))
        return engines[-1]

    monkeypatch.setattr(tiered_kv.cache, "make_engine", make)
    kv = {"k": torch.zeros(NUM_BLOCKS, WIDTH, dtype=torch.uint8), "v": torch.zeros(NUM_BLOCKS, WIDTH, dtype=torch.uint8)}
    layout = tkv.KVLayout.from_tensors(kv, NUM_BLOCKS)
    cfg = {
        "model": {"model_id": "test-model", "bytes_per_block": 2 * WIDTH},
        "gpu": {"num_blocks": NUM_BLOCKS},
        "tiers": {"cpu": {"capacity": 32 * 2 * WIDTH, "pin_memory": "off"}, "disk": {"enabled": False}},
    }
    rt = CacheThread(cfg, layout)
    yield rt, kv, engines[0]
    rt.close()


def test_a_timed_out_load_returns_only_after_its_copies_and_never_writes_later(runtime):
    rt, kv, engine = runtime
    keys = rt.keyer.keys_for_block_ids(range(4))
    for t in kv.values():
        t[:4] = torch.arange(4, dtype=torch.uint8)[:, None] + 1
    assert rt.call(rt.cache.store(keys, [0, 1, 2, 3])).stored == 4
    for t in kv.values():
        t.zero_()
    engine.delay, before = 1.0, engine.submitted
    with pytest.raises((tkv.TransferError, TimeoutError)) as raised:
        rt.call(rt.cache.load(keys, [8, 9, 10, 11]), timeout=0.3)
    returned = time.monotonic()
    seen = [t.clone() for t in kv.values()]
    check_copies_landed(engine, before, returned)
    time.sleep(1.2)
    for before, t in zip(seen, kv.values(), strict=True):
        assert torch.equal(before, t), "a copy wrote into the blocks after the call had returned"
    assert raised.match(r"timed out after 0.3 s; it was cancelled and its copies have landed")


def test_a_timed_out_store_is_discarded_after_its_copies_landed(runtime):
    rt, kv, engine = runtime
    keys = rt.keyer.keys_for_block_ids(range(20, 24))
    for t in kv.values():
        t[4:8].fill_(5)
    engine.delay, before = 1.0, engine.submitted
    with pytest.raises((tkv.TransferError, TimeoutError)) as raised:
        rt.call(rt.cache.store(keys, [4, 5, 6, 7]), timeout=0.3)
    returned = time.monotonic()
    check_copies_landed(engine, before, returned)
    assert isinstance(raised.value, tkv.TransferError) and raised.match("timed out")
    # vLLM reuses the blocks now; what the copy read from them must never be served.
    engine.delay = 0.0
    assert rt.lookup(keys) == 0
    assert rt.call(rt.cache.load(keys, [12, 13, 14, 15])) == 0


def test_a_call_that_ends_in_time_returns_its_result(runtime):
    rt, _kv, engine = runtime
    engine.delay = 0.05
    keys = rt.keyer.keys_for_block_ids(range(30, 32))
    assert rt.call(rt.cache.store(keys, [0, 1]), timeout=5).stored == 2
    with pytest.raises(tkv.BlockIdError):  # the call's own errors come through unchanged
        rt.call(rt.cache.load(keys, [99, 100]), timeout=5)
