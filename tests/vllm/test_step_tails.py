"""Hits that end inside a block and partial tail records (issue 39 item 2), with the connector's real halves
driven as vLLM 0.32 drives them (step_harness.py; blocks of 4 tokens).

A prompt whose last block is partial stores that block under a tail key once its forward computed it; a
later request whose tokens in that block begin with exactly those tokens, after the same prefix, is served
up to them (never its last prompt token). Each test checks what the answer counts and what landed in the
GPU blocks before the forward read them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
import step_harness  # noqa: E402
from step_harness import BS, Harness, request, token_values  # noqa: E402
from test_step_protocol import PREFIX, store_prompt  # noqa: E402

NEEDS_VLLM = True

A = PREFIX + [41, 42]  # 3 full blocks, then a tail of 2 tokens


@pytest.fixture
def h(tmp_path):
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def served(h: Harness, prompt: list[int], blocks: list[int], upto: int) -> bool:
    """The first ``upto`` positions of ``prompt`` hold its KV in ``blocks`` when this step's loads landed."""
    kv = h.after_start["layer.0"]
    want = token_values(prompt[:upto])
    return all(kv[blocks[p // BS], p % BS].equal(want[p]) for p in range(upto))


def admit_and_step(h: Harness, rid: str, prompt: list[int], blocks: list[int]) -> int:
    """Admit the request (whatever it hits), run its prefill step; returns the tokens it was served."""
    req = request(rid, prompt)
    n, is_async = h.admit(req, blocks)
    assert not is_async
    h.step(new=[(req, blocks, n, len(prompt) - n)])
    return n


def run_prompt(h: Harness, rid: str, prompt: list[int], blocks: list[int]) -> int:
    """``admit_and_step``, then until its stores landed, and finished."""
    n = admit_and_step(h, rid, prompt, blocks)
    h.idle()
    h.finish(request(rid, prompt))
    h.idle()
    return n


def test_the_960_token_prompt_served_from_the_cpu_tier_computes_one_token(tmp_path, monkeypatch):
    monkeypatch.setattr(step_harness, "NB", 500)  # 240 blocks of 4 tokens, twice
    h = Harness(tmp_path)
    try:
        prompt = [(7 * i) % 997 + 3 for i in range(960)]
        store_prompt(h, "a", prompt, list(range(240)))
        stored = h.counters()["stored_blocks"]
        assert stored == 240
        b = request("b", prompt)
        blocks = list(range(250, 490))
        n, is_async = h.admit(b, blocks)
        assert (n, is_async) == (959, False)  # the last block's full key is loaded; vLLM computes token 959
        assert h.sched.hit_sources("b", n) == {"cpu": 959}
        meta = h.step(new=[(b, blocks, n, 1)])
        assert h.holds(prompt, blocks, 240, kv=h.after_start)  # all 240 blocks landed before the forward
        assert not meta.store_jobs  # the loaded block is not stored again
        h.idle()
        assert h.counters()["stored_blocks"] == stored and h.counters()["loaded_blocks"] == 240
        assert h.counters().get("stored_tail_blocks", 0) == 0  # 960 is a whole number of blocks: no tail
    finally:
        h.close()


def test_a_tail_is_served_to_the_next_turn_and_that_block_is_stored_under_its_full_key(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    assert h.counters()["stored_blocks"] == 3 and h.counters()["stored_tail_blocks"] == 1
    # The next turn: A, then the answer and a question. Its block 3 begins with A's tail.
    b_prompt = A + [43, 44, 51, 52, 53]  # 4 full blocks, then a tail of 1
    blocks = [10, 11, 12, 13, 14]
    b = request("b", b_prompt)
    n, is_async = h.admit(b, blocks)
    assert (n, is_async) == (len(A), False)  # 3 blocks and A's 2 tail tokens
    meta = h.step(new=[(b, blocks, n, len(b_prompt) - n)])
    assert len(meta.sync_loads) == 1
    assert served(h, b_prompt, blocks, len(A))  # the tail's 2 positions landed in block 13 too
    h.idle()
    assert h.counters()["tail_hits"] == 1 and h.counters()["tail_hit_tokens"] == 2
    # Block 3 (tail positions loaded, the rest computed) is stored under its full key, and b's own tail.
    assert h.counters()["stored_blocks"] == 3 + 1 and h.counters()["stored_tail_blocks"] == 2
    h.finish(b)
    h.idle()
    c = request("c", b_prompt)
    n2, _ = h.admit(c, [20, 21, 22, 23, 24])
    assert n2 == len(b_prompt) - 1  # 4 full blocks and 2 of b's 3 tail tokens (the last one is computed)
    h.step(new=[(c, [20, 21, 22, 23, 24], n2, 1)])
    assert h.holds(b_prompt, [20, 21, 22, 23], 4, kv=h.after_start)


def test_tail_hits_count_the_tails_served_not_the_lookups_of_a_request_that_waits(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b_prompt = A + [43, 44, 7]
    b = request("b", b_prompt)
    h.sched.on_new_request(b)
    # vLLM asks again in every step a waiting request cannot be scheduled (no free blocks for it yet):
    # each answer is the tail hit, and none is served.
    for _ in range(6):
        assert h.sched.matched_tokens(b, 0) == (len(A), False)
        h.step()
    assert h.counters().get("tail_hits", 0) == 0 and h.counters().get("tail_hit_tokens", 0) == 0
    blocks = [10, 11, 12, 13, 14]
    n, _ = h.admit(b, blocks)  # then it is: one hit served
    assert n == len(A)
    h.step(new=[(b, blocks, n, len(b_prompt) - n)])
    assert served(h, b_prompt, blocks, len(A))
    h.idle()
    assert (h.counters()["tail_hits"], h.counters()["tail_hit_tokens"]) == (1, 2)
    h.finish(b)
    h.idle()
    # Another request served a tail (b's own, 1 token after its 4 full blocks): one more, of its tokens.
    c_prompt = b_prompt + [9, 9]
    c = request("c", c_prompt)
    for _ in range(3):
        assert h.sched.matched_tokens(c, 0) == (len(b_prompt), False)
        h.step()
    assert admit_and_step(h, "c", c_prompt, [20, 21, 22, 23, 24]) == len(b_prompt)
    h.idle()
    assert (h.counters()["tail_hits"], h.counters()["tail_hit_tokens"]) == (2, 3)
    assert h.counters().get("load_error_blocks", 0) == 0


def test_the_same_unaligned_prompt_again_is_served_up_to_its_last_token_and_stores_nothing_new(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    stored = h.counters()["stored_blocks"], h.counters()["stored_tail_blocks"]
    n = admit_and_step(h, "b", A, [10, 11, 12, 13])
    assert n == len(A) - 1
    assert served(h, A, [10, 11, 12, 13], len(A) - 1)
    h.idle()
    assert (h.counters()["stored_blocks"], h.counters()["stored_tail_blocks"]) == stored


@pytest.mark.parametrize(("prompt", "want"), [
    (PREFIX + [41, 43, 9, 9], 12),  # same prefix, the tail's second token differs
    (PREFIX + [40, 42, 9], 12),  # its first token differs
    (PREFIX + [41, 42, 9], 14),  # exactly the tail, then more: served
    ([11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 35, 41, 42, 9], 8),  # another prefix: no tail
], ids=["second-token", "first-token", "same", "other-prefix"])  # fmt: skip
def test_a_tail_never_matches_other_tokens(h, prompt, want):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    n = admit_and_step(h, "b", prompt, [10, 11, 12, 13])
    assert n == want
    assert served(h, prompt, [10, 11, 12, 13], n)


def test_the_longest_stored_tail_that_the_request_begins_with_is_served(h):
    store_prompt(h, "t1", PREFIX + [41], [0, 1, 2, 3])
    run_prompt(h, "t3", PREFIX + [41, 42, 43], [4, 5, 6, 7])
    assert h.counters()["stored_tail_blocks"] == 2
    # Its block 3 begins with [41] but not with [41, 42, 43]: the shorter tail.
    assert admit_and_step(h, "b", PREFIX + [41, 42, 99, 100, 7], [10, 11, 12, 13, 14]) == 13
    # The longer one matches: 3 tail tokens.
    assert admit_and_step(h, "c", PREFIX + [41, 42, 43, 44, 7], [20, 21, 22, 23, 24]) == 15
    assert served(h, PREFIX + [41, 42, 43, 44, 7], [20, 21, 22, 23, 24], 15)
    # A request with only 2 tokens in that block cannot use the 3-token tail: [41], and its last token is computed.
    assert admit_and_step(h, "d", PREFIX + [41, 42], [30, 31, 32, 33]) == 13


def test_a_tail_never_stands_in_for_a_full_block_nor_a_full_block_for_a_tail(h):
    full = PREFIX + [41, 42, 43, 44]  # block 3 full: its full key
    store_prompt(h, "f", full + [9], [0, 1, 2, 3, 4])
    run_prompt(h, "t", PREFIX + [41, 42, 43], [5, 6, 7, 8])  # the same 3 tokens, as a tail
    # Block 3 = [41, 42, 43, 99]: only the tail's 3 tokens, never the full block [41, 42, 43, 44].
    p = PREFIX + [41, 42, 43, 99, 7]
    assert admit_and_step(h, "b", p, [10, 11, 12, 13, 14]) == 15 and served(h, p, [10, 11, 12, 13, 14], 15)
    # Block 3 = [41, 42, 43, 44]: the full block, and f's tail [9] after it.
    q = full + [9, 8]
    assert admit_and_step(h, "c", q, [20, 21, 22, 23, 24]) == 17 and served(h, q, [20, 21, 22, 23, 24], 17)
    # Block 3 = [41, 42, 43, 0]: what a zero-padded tail would look like as a full block. The tail, not more.
    z = PREFIX + [41, 42, 43, 0, 7]
    assert admit_and_step(h, "z", z, [30, 31, 32, 33, 34]) == 15 and served(h, z, [30, 31, 32, 33, 34], 15)


def test_a_tail_is_also_found_after_vllms_own_prefix_hit(h):
    store_prompt(h, "a", A, [0, 1, 2, 3])
    b_prompt = A + [43, 44, 8]
    b = request("b", b_prompt)
    n, _ = h.admit(b, [0, 1, 2, 13, 14], num_computed=3 * BS)  # vLLM's own cache holds the 3 full blocks
    assert n == 2  # the tail's tokens on top of them
    h.step(new=[(b, [0, 1, 2, 13, 14], 3 * BS + n, len(b_prompt) - 3 * BS - n)])
    assert served(h, b_prompt, [0, 1, 2, 13, 14], len(A))


@pytest.mark.parametrize("after_a_hit", [False, True], ids=["stored", "loaded"])
def test_a_partial_record_is_dropped_first_under_pressure(tmp_path, after_a_hit):
    h = Harness(tmp_path, cpu=f"{6 * BS * 2 * 8 * 4}B")  # 6 slots
    try:
        d = [91, 92, 93, 94]  # one full block
        store_prompt(h, "d", d, [0])
        store_prompt(h, "a", A, [1, 2, 3, 4])  # 3 blocks and a tail, all more recent than d's block
        if after_a_hit:  # the next turn loads the tail (a load touches what it loads), stores its block 3
            assert run_prompt(h, "b", A + [43, 44], [10, 11, 12, 13]) == len(A)
        else:
            store_prompt(h, "b", [71, 72, 73, 74], [5])
        assert h.sched.report()["stats"]["cpu"]["resident"] == 6
        store_prompt(h, "e", [81, 82, 83, 84], [6])  # another prompt's full block needs a slot
        # The tail went, not d's older full block.
        assert h.sched.matched_tokens(request("d2", d), 0)[0] == len(d) - 1
        assert h.sched.matched_tokens(request("a2", A), 0)[0] == 3 * BS  # A's full blocks, no tail
    finally:
        h.close()


def test_an_asynchronous_tail_hit_lands_then_its_request_computes_from_it(tmp_path):
    h = Harness(tmp_path, inflight=f"{BS * 2 * 8 * 4}B")  # one block at a time
    try:
        store_prompt(h, "a", A, [0, 1, 2, 3])
        x = request("x", [61, 62, 63, 64, 71, 72, 73, 74, 81])
        h.admit(x, [20, 21, 22])
        h.step(new=[(x, [20, 21, 22], 0, 9)], report=False)  # its store holds the byte budget
        b_prompt = A + [43, 44, 7]
        b = request("b", b_prompt)
        blocks = [10, 11, 12, 13, 14]
        n, is_async = h.admit(b, blocks)
        assert (n, is_async) == (len(A), True)
        for _ in range(20):
            h.step()
            if "b" in h.finished_recving:
                break
        assert "b" in h.finished_recving
        assert (h.counters()["tail_hits"], h.counters()["tail_hit_tokens"]) == (1, 2)  # once it landed
        assert all(h.kv["layer.0"][blocks[p // BS], p % BS].equal(token_values(b_prompt[p : p + 1])[0])
                   for p in range(len(A)))  # fmt: skip
        h.step(new=[(b, blocks, n, len(b_prompt) - n)])
        h.idle()
        stored = h.counters()["stored_blocks"]
        h.finish(b)
        h.idle()
        c = request("c", b_prompt)
        n2, _ = h.admit(c, [30, 31, 32, 33, 34])
        assert n2 == 4 * BS and stored >= 3 + 2 + 1  # block 3 was stored under its full key
        h.step(new=[(c, [30, 31, 32, 33, 34], n2, 1)])
        assert h.holds(b_prompt, [30, 31, 32, 33], 4, kv=h.after_start)
    finally:
        h.close()
