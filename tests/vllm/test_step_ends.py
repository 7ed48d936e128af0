"""Requests that end (finish or abort) in the step that loaded or stored them (issue 36), with the
connector's real halves driven as vLLM 0.32 drives them (step_harness.py).

vLLM frees a finished request's blocks at once unless request_finished says True, and hands them to the
next request: a store of them issued later commits that request's KV under this prompt's keys. Each test
plays vLLM's side faithfully: a block comes back to the pool when vLLM would free it (at once, or once
the request is in finished_sending), and the next request that gets it overwrites it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
from step_harness import BS, Harness, request  # noqa: E402
from test_step_protocol import PREFIX, A, C, store_prompt  # noqa: E402

NEEDS_VLLM = True

B4 = PREFIX + [51, 52, 53, 54, 55]  # A's 3 prefix blocks, then a 4th full block its forward computes
D = [91, 92, 93, 94]  # another request's one block


def reuse_when_freed(h: Harness, rid: str, held: bool, block: int) -> None:
    """vLLM gives ``block`` to request d once ``rid`` freed it, and d's forward overwrites it."""
    for _ in range(20):
        if not held or rid in h.finished_sending:
            break
        h.step()
    d = request(f"d-{rid}", D)
    h.admit(d, [block])
    h.step(new=[(d, [block], 0, len(D))])


@pytest.mark.parametrize("reported", [True, False], ids=["finished", "aborted-before-report"])
def test_a_request_served_by_a_sync_hit_that_ends_in_that_step_is_held_for_its_store(tmp_path, reported):
    # The byte budget holds one 3-block hit: b's store of the block its forward computes waits for the
    # load's report, so it is issued a step later (what a slow copy does on any busy machine).
    h = Harness(tmp_path, inflight=f"{3 * BS * 2 * 8 * 4}B")
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        b = request("b", B4)
        blocks = [10, 11, 12, 13, 14]
        n, is_async = h.admit(b, blocks)
        assert (n, is_async) == (3 * BS, False)
        h.step(new=[(b, blocks, n, len(B4) - n)], report=reported)
        held = h.finish(b)  # max_tokens=1, EOS on the first token, an abort: in the step of the hit
        assert held is True
        reuse_when_freed(h, "b", held, 13)
        h.idle(5)
        e = request("e", B4)
        n2, _ = h.admit(e, [30, 31, 32, 33, 34])
        assert n2 == 4 * BS
        h.step(new=[(e, [30, 31, 32, 33, 34], n2, len(B4) - n2)])
        assert h.holds(B4, [30, 31, 32, 33], 4, kv=h.after_start)  # b's KV, not d's
    finally:
        h.close()


@pytest.mark.parametrize("reported", [True, False], ids=["finished", "aborted-before-report"])
def test_a_request_that_ends_in_the_step_of_its_store_is_held_until_the_store_resolves(tmp_path, reported):
    h = Harness(tmp_path, inflight=f"{BS * 2 * 8 * 4}B")  # one block at a time: the 2-block store waits
    try:
        x = request("x", C)
        h.admit(x, [20, 21, 22])
        h.step(new=[(x, [20, 21, 22], 0, len(C))], report=reported)
        held = h.finish(x)
        assert held is True
        reuse_when_freed(h, "x", held, 21)
        h.idle(8)
        y = request("y", C)
        n, _ = h.admit(y, [40, 41, 42])
        if n:  # whatever landed is x's KV
            for _ in range(20):
                h.step()
                if "y" in h.finished_recving or h.metas[-1].sync_loads:
                    break
            assert h.holds(C, [40, 41], n // BS)
    finally:
        h.close()


@pytest.mark.parametrize("at", ["before-landing", "after-landing"])
def test_a_request_aborted_during_its_async_load_is_freed_by_finished_recving_and_leaves_no_state(tmp_path, at):
    h = Harness(tmp_path, inflight=f"{BS * 2 * 8 * 4}B")
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        x = request("x", C)
        h.admit(x, [20, 21, 22])
        h.step(new=[(x, [20, 21, 22], 0, len(C))], report=False)  # its store holds the budget: b goes async
        b = request("b", B4)
        n, is_async = h.admit(b, [10, 11, 12, 13, 14])
        assert (n, is_async) == (3 * BS, True)
        if at == "after-landing":
            h.step()
        # vLLM holds the blocks of a request waiting for its load itself, until finished_recving: a True
        # here would make it free them twice (its finished_sending would find the request gone).
        assert h.finish(b) is False
        for _ in range(20):
            h.step()
            if "b" in h.finished_recving:
                break
        assert "b" in h.finished_recving
        assert "b" not in h.finished_sending
        h.idle()
        # The id comes back with another prompt: it must not inherit the old load's cap or store cursor.
        again = request("b", C + [95, 96, 97, 98])
        h.sched.on_new_request(again)
        h.step(new=[(again, [24, 25, 26, 27], 0, len(again.prompt_token_ids))])
        h.idle(8)
        assert h.finish(again) in (True, False)
        h.idle(5)
        z = request("z", again.prompt_token_ids)
        n3, _ = h.admit(z, [28, 29, 30, 31])
        assert n3 == 3 * BS  # every full block of the new prompt was stored (none skipped as "loaded")
    finally:
        h.close()


def test_a_load_admitted_with_another_token_count_is_an_error_for_the_request(tmp_path):
    h = Harness(tmp_path)
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        b = request("b", B4)
        h.sched.on_new_request(b)
        n, _ = h.sched.matched_tokens(b, 0)
        assert n == 3 * BS
        from types import SimpleNamespace as NS

        blocks = [10, 11, 12, 13, 14]
        h.sched.after_alloc(b, NS(get_block_ids=lambda: (blocks,)), 2 * BS)  # vLLM admitted fewer
        h.step(new=[(b, blocks, 2 * BS, len(B4) - 2 * BS)])
        assert h.load_errors[-1] == {10, 11}  # reported: vLLM recomputes them, never reads them unloaded
        assert h.counters()["load_admission_mismatches"] == 1
    finally:
        h.close()


def test_reset_leaves_the_tiers_alone_when_vllms_own_reset_failed(tmp_path):
    from vllm.v1.core.block_pool import BlockPool

    h = Harness(tmp_path)
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BS)
        h.sched.bind_vllm_cache(type("KVCacheManager", (), {"block_pool": pool})())
        taken = pool.get_new_blocks(1)  # a request still holds a block: vLLM's reset_prefix_cache failed
        assert pool.reset_prefix_cache() is False
        assert h.sched.reset() is False  # so the connector's reset (called anyway) changes nothing
        assert h.sched.matched_tokens(request("b", A), 0)[0] == len(A) - 1  # 3 blocks and A's partial tail
        pool.free_blocks(taken)
        assert pool.reset_prefix_cache() is True
        assert h.sched.reset() is True
        assert h.sched.matched_tokens(request("c", A), 0) == (0, False)
    finally:
        h.close()
