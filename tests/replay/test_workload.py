"""The built-in chat workload: determinism, chained ids, growing conversations, statistics."""

from __future__ import annotations

import math

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.replay.simulate import simulate_belady, simulate_lru, simulate_unbounded, unique_blocks
from tiered_kv.replay.trace import Request
from tiered_kv.replay.workload import chat_workload


@pytest.fixture(scope="module")
def default_run() -> list[Request]:
    return chat_workload(3000, seed=0)


def test_deterministic_per_seed():
    a = chat_workload(400, seed=7)
    assert a == chat_workload(400, seed=7)
    assert a != chat_workload(400, seed=8)
    # A shorter run is a prefix of a longer one with the same seed.
    assert chat_workload(100, seed=7) == a[:100]


def test_requests_are_well_formed(default_run):
    assert len(default_run) == 3000
    times = [r.timestamp_ms for r in default_run]
    assert times == sorted(times) and times[0] > 0
    for r in default_run:
        assert isinstance(r, Request)
        assert r.input_length > 0 and r.output_length >= 0
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)


def test_ids_are_chain_consistent(default_run):
    # An id must always follow the same parent at the same depth: then equal id <=> equal prefix.
    parent: dict[int, int | None] = {}
    depth: dict[int, int] = {}
    for r in default_run:
        assert len(set(r.hash_ids)) == len(r.hash_ids)
        prev = None
        for k, h in enumerate(r.hash_ids):
            assert parent.setdefault(h, prev) == prev
            assert depth.setdefault(h, k) == k
            prev = h


def test_conversations_grow_turn_by_turn():
    # No one-offs, one conversation open at a time, 4 turns each: requests come in runs of 4.
    reqs = chat_workload(40, seed=3, one_off_fraction=0.0, new_conversation_fraction=0.0, turns=(4, 4))
    for start in range(0, 40, 4):
        conv = reqs[start : start + 4]
        for prev, cur in zip(conv, conv[1:], strict=False):
            # This turn = previous input + reply + a new user message.
            assert cur.input_length > prev.input_length + prev.output_length
            full = prev.input_length // 512
            assert cur.hash_ids[:full] == prev.hash_ids[:full]
            if prev.input_length % 512:
                # The partial tail block got filled, so (like a real chained hash) its id changes.
                assert cur.hash_ids[full] != prev.hash_ids[full]
        if start:
            # A new conversation shares at most the system prompt with the last one.
            before, first = reqs[start - 1].hash_ids, conv[0].hash_ids
            shared = 0
            while shared < min(len(before), len(first)) and before[shared] == first[shared]:
                shared += 1
            assert shared <= 12  # system_prompt_blocks tops out at 12


def test_system_prompts_are_shared():
    reqs = chat_workload(300, seed=1, one_off_fraction=0.0, num_system_prompts=3, system_prompt_blocks=(2, 4))
    heads = {r.hash_ids[:2] for r in reqs}
    assert len(heads) <= 3  # every request starts with one of three prompts
    assert len({r.hash_ids[0] for r in reqs}) >= 2  # and more than one is in use


def test_one_offs_share_nothing():
    reqs = chat_workload(200, seed=2, one_off_fraction=1.0)
    assert unique_blocks(reqs) == sum(len(r.hash_ids) for r in reqs)
    assert simulate_unbounded(reqs).hit_blocks == 0


def test_default_statistics_in_range(default_run):
    unique = unique_blocks(default_run)
    unbounded = simulate_unbounded(default_run).hit_rate
    assert 10_000 <= unique <= 20_000
    assert 0.50 <= unbounded <= 0.70
    # Skewed, interleaved revisits: the offline optimum beats LRU clearly at a small cache.
    cap = unique // 20
    assert simulate_belady(default_run, cap).hit_rate > simulate_lru(default_run, cap).hit_rate + 0.05


def test_some_conversations_return_after_long_gaps(default_run):
    last: dict[int, int] = {}
    gaps = []
    for i, r in enumerate(default_run):
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[k] in last:
            k += 1
        if k:
            gaps.append(i - last[r.hash_ids[k - 1]])
        for h in r.hash_ids:
            last[h] = i
    gaps.sort()
    assert gaps[len(gaps) // 2] < 100  # most reuse is near
    assert sum(g >= 500 for g in gaps) >= 0.03 * len(gaps)  # but a tail comes back much later


@pytest.mark.parametrize("seed", [1, 2])
def test_other_seeds_stay_in_range(seed):
    reqs = chat_workload(3000, seed=seed)
    assert 10_000 <= unique_blocks(reqs) <= 20_000
    assert 0.50 <= simulate_unbounded(reqs).hit_rate <= 0.70


def test_block_tokens_changes_granularity():
    reqs = chat_workload(50, seed=0, block_tokens=128)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 128) for r in reqs)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"num_requests": -1}, "num_requests"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"system_prompt_blocks": (5, 2)}, "system_prompt_blocks"),
        ({"turns": (0, 3)}, "turns"),
        ({"one_off_fraction": 1.5}, "one_off_fraction"),
        ({"document_fraction": -0.1}, "document_fraction"),
        ({"reply_tokens": (10, 5)}, "reply_tokens"),
        ({"mean_interarrival_ms": 0.0}, "mean_interarrival_ms"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        chat_workload(**kwargs)


def test_zero_requests():
    assert chat_workload(0) == []


# -- sessions (frontend hints) -------------------------------------------------------------------
def test_sessions_group_conversations_and_mark_their_last_turn(default_run):
    by_session: dict[int, list[Request]] = {}
    for r in default_run:
        assert isinstance(r.session, int)
        by_session.setdefault(r.session, []).append(r)
    # Ids are given in order of first appearance.
    assert list(by_session) == list(range(len(by_session)))  # dicts keep first-insertion order
    closed = 0
    for turns in by_session.values():
        # Only a session's final request may be its last turn.
        assert not any(r.last_turn for r in turns[:-1])
        closed += turns[-1].last_turn
        for prev, cur in zip(turns, turns[1:], strict=False):  # one conversation: each turn extends the last
            full = prev.input_length // 512
            assert cur.hash_ids[:full] == prev.hash_ids[:full] and cur.input_length > prev.input_length
    # Cold conversations may still be open when the workload ends: no last turn (yet).
    assert len(by_session) // 2 < closed < len(by_session)


def test_a_one_off_is_its_own_session_and_its_last_turn():
    reqs = chat_workload(50, seed=2, one_off_fraction=1.0)
    assert [r.session for r in reqs] == list(range(50)) and all(r.last_turn for r in reqs)
    convs = chat_workload(40, seed=3, one_off_fraction=0.0, new_conversation_fraction=0.0, turns=(4, 4))
    assert [r.session for r in convs] == [i // 4 for i in range(40)]
    assert [r.last_turn for r in convs] == [i % 4 == 3 for i in range(40)]


def test_sessions_leave_the_blocks_unchanged():
    """Session ids are drawn from no random stream: the same seed gives the same block ids."""
    reqs = chat_workload(300, seed=5)
    assert unique_blocks(reqs) == unique_blocks([Request(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in reqs])
    fingerprint = hash(tuple(r.hash_ids for r in reqs))
    assert fingerprint == hash(tuple(r.hash_ids for r in chat_workload(300, seed=5)))
