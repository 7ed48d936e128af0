"""Disk hits promoted into the CPU tier before they hold GPU blocks (issue 39 item 3), with the connector's
real halves driven as vLLM 0.32 drives them (step_harness.py) and a real disk tier under tmp_path.

vLLM allocates a request's GPU blocks only once get_num_new_matched_tokens answered a number (then calls
update_state_after_alloc); an answer of None skips the request this step and asks again the next. So a
request that holds no GPU blocks during its disk read is one answered None until the read has landed,
with no load job of it in any step's metadata until then.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
from step_harness import BS, Harness, request  # noqa: E402
from test_step_protocol import PREFIX, B, store_prompt  # noqa: E402

NEEDS_VLLM = True

BLOCK = BS * 2 * 8 * 4  # bytes per block in the harness
OTHERS = [[100 * i + j for j in range(3 * BS)] for i in range(1, 5)]  # prompts that push PREFIX to disk


def prefix_on_disk(h: Harness) -> None:
    """PREFIX's 3 blocks stored, then evicted to disk by later prompts (write-back)."""
    store_prompt(h, "a", PREFIX + [41, 42], [0, 1, 2, 3])
    for i, prompt in enumerate(OTHERS):
        store_prompt(h, f"o{i}", prompt, [20 + 3 * i, 21 + 3 * i, 22 + 3 * i])
    where = on_loop(h, lambda c: c.tiers_of(h.sched._keys.get("probe", PREFIX)[0][:3]))
    assert where == ["disk"] * 3, where


def on_loop(h: Harness, fn):
    cache = h.sched._calls.opened.cache

    async def run():
        return fn(cache)

    return h.sched._calls._loop.call(run())


def ask_until_answered(h: Harness, req, steps: int = 50) -> tuple[int, bool, int]:
    """vLLM's loop: ask each step until a number comes; returns it, and the steps answered None."""
    skipped = 0
    for _ in range(steps):
        n, is_async = h.sched.matched_tokens(req, 0)
        if n is not None:
            return n, is_async, skipped
        skipped += 1
        meta = h.step()  # nothing of it is scheduled: no GPU blocks, no load job
        assert not meta.load_jobs and not meta.sync_loads
        time.sleep(0.005)
    raise AssertionError(f"still answered None after {steps} steps")


@pytest.fixture
def h(tmp_path):
    """A CPU tier of 6 blocks over a disk tier: a prefix stored once and evicted lies on disk."""
    harness = Harness(tmp_path, cpu=f"{6 * BLOCK}B", disk="64KiB")
    yield harness
    harness.close()


def test_a_disk_hit_is_promoted_before_it_holds_gpu_blocks_then_served_as_a_sync_cpu_hit(h):
    prefix_on_disk(h)
    b = request("b", B)
    h.sched.on_new_request(b)
    assert h.sched.matched_tokens(b, 0) == (None, False)  # no GPU blocks during the disk read
    n, is_async, skipped = ask_until_answered(h, b)
    assert (n, is_async) == (3 * BS, False)  # then a synchronous CPU hit
    assert h.counters()["promotions"] == 1 and h.counters()["promoted_blocks"] == 3
    blocks = [10, 11, 12, 13]
    h.sched.after_alloc(b, _blocks(blocks), n)
    meta = h.step(new=[(b, blocks, n, len(B) - n)])
    assert meta.sync_loads  # loaded in the step it was answered, before its forward
    assert h.holds(B, blocks, 3, kv=h.after_start)  # PREFIX's bytes, read back from disk
    assert "b" not in h.finished_recving


def test_without_promotion_a_disk_hit_is_an_async_load_that_holds_its_blocks(tmp_path):
    """The behaviour before (``promote_hits: false``): the contrast to the test above."""
    h = Harness(tmp_path, cpu=f"{6 * BLOCK}B", disk="64KiB", extra={"promote_hits": False})
    try:
        prefix_on_disk(h)
        b = request("b", B)
        h.sched.on_new_request(b)
        assert h.sched.matched_tokens(b, 0) == (3 * BS, True)
    finally:
        h.close()


def test_a_request_aborted_while_promoting_leaves_nothing_behind(h):
    prefix_on_disk(h)
    b = request("b", B)
    h.sched.on_new_request(b)
    assert h.sched.matched_tokens(b, 0) == (None, False)
    assert h.finish(b) is False  # aborted while waiting: vLLM holds no blocks of it
    h.idle(5)
    promotions = h.sched._promotions
    assert promotions.running() == [] and not promotions.busy
    assert "b" not in promotions._done
    on_loop(h, lambda c: c.check_invariants())
    assert on_loop(h, lambda c: c.manager.cpu.n_ready_pinned) == 0
    # The id comes back: it gets its own promotion, and a hit with the right bytes.
    again = request("b", B)
    h.sched.on_new_request(again)
    n, is_async, _ = ask_until_answered(h, again)
    assert (n, is_async) == (3 * BS, False)
    h.sched.after_alloc(again, _blocks([30, 31, 32, 33]), n)
    h.step(new=[(again, [30, 31, 32, 33], n, len(B) - n)])
    assert h.holds(B, [30, 31, 32, 33], 3, kv=h.after_start)


def test_a_hit_evicted_again_after_its_promotion_falls_back_to_an_async_load(h):
    # The promoted blocks are evicted (to disk) before vLLM asks again: after its one promotion the request
    # is served as an asynchronous load (vLLM holds its blocks), never skipped again.
    prefix_on_disk(h)
    b = request("b", B)
    h.sched.on_new_request(b)
    assert h.sched.matched_tokens(b, 0) == (None, False)
    future = h.sched._promotions._running["b"]
    future.result(10)
    for i in range(2):  # 6 more blocks: the promoted ones go back to disk
        prompt = [1000 * (i + 5) + j for j in range(3 * BS)]
        store_prompt(h, f"p{i}", prompt, [40 + 3 * i, 41 + 3 * i, 42 + 3 * i])
    n, is_async = h.sched.matched_tokens(b, 0)
    assert (n, is_async) == (3 * BS, True)
    assert h.counters()["promotions"] == 1
    blocks = [10, 11, 12, 13]
    h.sched.after_alloc(b, _blocks(blocks), n)
    for _ in range(50):
        h.step()
        if "b" in h.finished_recving:
            break
        time.sleep(0.005)
    assert "b" in h.finished_recving
    assert h.holds(B, blocks, 3)


def _blocks(ids: list[int]):
    from types import SimpleNamespace as NS

    return NS(get_block_ids=lambda: (list(ids),))
