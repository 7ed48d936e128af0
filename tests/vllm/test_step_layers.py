"""Layer-wise synchronous loads through the worker half (issue 39 item 4), with the connector's real halves
driven as vLLM 0.32 drives them (step_harness.py, four layers: each attention layer calls
wait_for_layer_load before it reads its KV, and the harness reads each layer right after its wait).
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`"
)
from step_harness import BS, Harness, request  # noqa: E402
from test_step_protocol import PREFIX, B, store_prompt  # noqa: E402

NEEDS_VLLM = True

A = PREFIX + [41, 42]  # 3 full blocks and a 2-token tail


def test_a_cpu_hit_on_a_four_layer_rank_is_loaded_layer_by_layer_with_every_layers_bytes(tmp_path):
    h = Harness(tmp_path, layers=4)
    try:
        assert h.worker._layers  # host engine, four layer tensors: layered
        store_prompt(h, "a", A, [0, 1, 2, 3])
        h.worker._copier._layers._pace = lambda g: time.sleep(0.03)  # a layer lands well after the one before
        b = request("b", B)
        blocks = [10, 11, 12, 13]
        n, is_async = h.admit(b, blocks)
        assert (n, is_async) == (3 * BS, False)
        meta = h.step(new=[(b, blocks, n, len(B) - n)])
        assert meta.sync_loads and h.load_errors[-1] == set()
        assert h.holds(B, blocks, 3, kv=h.after_start)  # each layer as its attention read it
        assert h.holds(B, blocks, 3)
    finally:
        h.close()


def test_a_tail_hit_block_is_loaded_before_the_forward_writes_past_the_tail(tmp_path):
    # The hit ends inside block 3 (A's 2-token tail): the forward writes positions 14.. of that block in
    # every layer, and no layer's copy may land after and overwrite them.
    h = Harness(tmp_path, layers=4)
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        h.worker._copier._layers._pace = lambda g: time.sleep(0.03)  # each layer lands after its write
        prompt = A + [43, 44, 45, 46, 47]
        c = request("c", prompt)
        blocks = [20, 21, 22, 23, 24]
        n, is_async = h.admit(c, blocks)
        assert (n, is_async) == (len(A), False)
        h.step(new=[(c, blocks, n, len(prompt) - n)])
        h.idle()
        assert h.holds(prompt, blocks, 4)  # 16 positions: the tail's and the computed ones
    finally:
        h.close()


def test_wait_for_layer_load_waits_for_that_layer_only(tmp_path):
    h = Harness(tmp_path, layers=4)
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        gate = threading.Event()
        layers = h.worker._copier._layers
        layers._pace = lambda g: gate.wait(10) if g == 2 else time.sleep(0.05)  # layers 2 and 3 held back
        b = request("b", B)
        blocks = [10, 11, 12, 13]
        n, _ = h.admit(b, blocks)
        meta = h.sched.build_meta(_new_step(b, blocks, n))
        h.worker.start(meta)
        h.worker.wait_layer("layer.1")  # returns: layer 1 landed while layer 2 is held
        assert not h.worker._layered.events[2].is_set()
        kv = list(h.kv.values())
        assert int(kv[3][blocks[:2]].abs().sum()) == 0  # layer 3's blocks not copied yet
        assert float(kv[1][blocks[0]].abs().sum()) > 0
        gate.set()
        h.worker.wait_layer("layer.3")
        h.worker.save()
        assert h.holds(B, blocks, 3)
    finally:
        gate.set()
        h.close()


def _new_step(req, blocks, n):
    from types import SimpleNamespace as NS

    new = NS(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=(list(blocks),),
        num_computed_tokens=n,
    )
    cached = NS(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    scheduled = {req.request_id: len(req.prompt_token_ids) - n}
    return NS(
        preempted_req_ids=set(),
        finished_req_ids=set(),
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
    )
