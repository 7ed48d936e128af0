"""Partial tail keys (scheduler/tail_keys.py), their side index, and the cold end they are stored at
(TierManager.demote): a tail matches only the same prefix followed by exactly its tokens, never a full block."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest

from tiered_kv.keys import BlockKeyer, KeyNamespace
from tiered_kv.manager import TierManager
from tiered_kv.scheduler.request_keys import request_block_keys, request_salt
from tiered_kv.scheduler.tail_keys import TAIL_MARK, TailIndex, tail_key

BS = 4
KEYER = BlockKeyer(KeyNamespace("m", "float16", "abcd", BS))
PROMPT = [11, 12, 13, 14, 21, 22, 23, 24]  # two full blocks


def full_keys(prompt: list[int], salt=()) -> list[bytes]:
    return request_block_keys(KEYER, prompt, BS, salt)


def test_a_tail_is_keyed_by_its_prefix_and_exactly_its_tokens():
    parent = full_keys(PROMPT)[-1]
    key = tail_key(KEYER, parent, [31, 32], BS)
    assert len(key) == KEYER.key_bytes
    assert key == tail_key(KEYER, parent, [31, 32], BS)  # deterministic: another process finds it
    assert key != tail_key(KEYER, parent, [31, 33], BS)  # same prefix, another tail token
    assert key != tail_key(KEYER, parent, [31], BS)  # a shorter tail
    assert key != tail_key(KEYER, parent, [31, 32, 33], BS)  # a longer tail
    assert key != tail_key(KEYER, full_keys([11, 12, 13, 14, 21, 22, 23, 25])[-1], [31, 32], BS)  # other prefix
    assert key != tail_key(KEYER, full_keys(PROMPT, request_salt(cache_salt="x"))[-1], [31, 32], BS)  # salted


def test_trailing_zero_tokens_still_make_another_tail():
    # The tail is zero-padded to a fixed width: only its length word tells [5] from [5, 0].
    parent = full_keys(PROMPT)[-1]
    assert tail_key(KEYER, parent, [5], BS) != tail_key(KEYER, parent, [5, 0], BS)
    assert tail_key(KEYER, parent, [0], BS) != tail_key(KEYER, parent, [0, 0, 0], BS)


def test_a_tail_never_equals_a_full_blocks_key():
    parent = full_keys(PROMPT)[-1]
    vocab = [0, 1, 2, 31]  # 0 pads a tail, 1..3 are its possible lengths
    tails = {tail_key(KEYER, parent, list(t), BS) for m in range(1, BS) for t in itertools.product(vocab, repeat=m)}
    assert len(tails) == sum(len(vocab) ** m for m in range(1, BS))  # no two tails collide either
    # Every full block over that vocabulary after the same parent: never a tail's key.
    fulls = {KEYER.chain(parent, list(b)) for b in itertools.product(vocab, repeat=BS)}
    assert not fulls & tails
    # Nor a salted first block's.
    salt = request_salt(cache_salt="x")
    firsts = {request_block_keys(KEYER, list(b), BS, salt)[0] for b in itertools.product(vocab, repeat=BS)}
    assert not firsts & tails
    # A tail's input is block_size + 2 words beginning with a negative marker; a full block's is
    # block_size (or block_size + 4, salted) beginning with a token id >= 0.
    assert TAIL_MARK < 0
    assert BS + 2 not in (BS, BS + 4)


def test_a_tail_needs_a_parent_and_one_to_block_size_minus_one_tokens():
    parent = full_keys(PROMPT)[-1]
    with pytest.raises(ValueError):
        tail_key(KEYER, parent, [], BS)
    with pytest.raises(ValueError):
        tail_key(KEYER, parent, [1, 2, 3, 4], BS)  # a whole block has a full key, never a tail
    with pytest.raises(ValueError):
        tail_key(KEYER, b"short", [1], BS)


def test_the_index_gives_stored_lengths_longest_first_and_is_bounded():
    idx = TailIndex(cap=2)
    a, b, c = (hashlib.sha256(x).digest() for x in (b"a", b"b", b"c"))
    idx.add(a, 1)
    idx.add(a, 3)
    idx.add(a, 3)
    idx.add(a, 2)
    assert list(idx.lengths(a, 3)) == [3, 2, 1]
    assert list(idx.lengths(a, 2)) == [2, 1]  # the request has only 2 tokens in that block
    assert list(idx.lengths(b, 3)) == []
    idx.add(b, 1)
    idx.add(a, 1)  # a is the most recent parent now
    idx.add(c, 2)  # over the cap: b, the least recently added parent, goes
    assert len(idx) == 2 and list(idx.lengths(b, 3)) == [] and list(idx.lengths(a, 3)) == [3, 2, 1]
    idx.clear()
    assert len(idx) == 0


def _store(m: TierManager, ks: list[bytes]) -> None:
    plan = m.stores.prepare(ks, np.arange(len(ks), dtype=np.int64))
    m.stores.complete(plan, True)


def _evicted(m: TierManager) -> list[bytes]:
    return [k for kind, _, keys in m.take_events() if kind == "evicted" for k in keys]


@pytest.mark.parametrize("policy", ["lru", "arc", "window"])
def test_a_demoted_block_is_the_first_to_go(policy):
    m = TierManager(4, None, KEYER.key_bytes, policy)
    chain = full_keys(PROMPT + [31, 32, 33, 34])
    tail = tail_key(KEYER, chain[-1], [41], BS)
    _store(m, chain)
    _store(m, [tail])  # the most recent block: the policy alone would evict chain[-1] first
    assert m.demote([tail]) == 1
    m.take_events()
    _store(m, full_keys([7, 7, 7, 7]))
    assert _evicted(m) == [tail]
    assert m.lookup(chain).total == 3
    m.check_invariants()


def test_demote_with_a_disk_tier_drops_the_block_and_never_spills_it():
    m = TierManager(2, 8, KEYER.key_bytes)
    a, tail = full_keys(PROMPT)[0], tail_key(KEYER, full_keys(PROMPT)[0], [21], BS)
    _store(m, [a])
    _store(m, [tail])
    assert m.demote([tail, b"\0" * KEYER.key_bytes]) == 1  # a key nobody holds is left alone
    m.take_events()
    plan = m.stores.prepare(full_keys([7, 7, 7, 7]), np.arange(1, dtype=np.int64))
    assert plan.spill is None  # the cold block is dropped, not written down
    m.stores.complete(plan, True)
    assert m.tiers_of([a, tail]) == ["cpu", ""]
    m.check_invariants()


def test_demote_of_nothing_or_of_missing_keys_changes_nothing():
    m = TierManager(2, None, KEYER.key_bytes)
    assert m.demote([]) == 0
    assert m.demote(full_keys(PROMPT)) == 0


def test_only_a_model_with_one_full_attention_group_answers_inside_a_block_and_stores_tails():
    from types import SimpleNamespace

    from tiered_kv.scheduler.groups import FULL, SLIDING, Group, KVGroups
    from tiered_kv.scheduler.tails import Tails

    one = Tails(KVGroups((Group(0, FULL, ("a",)),), 1), 32)
    assert (one.inside, one.records) == (True, True)
    assert one.bounds(960, 960 // 32 + 1) == (30, 959)  # every block of the 960-token prompt, 959 tokens
    assert one.bounds(1000, 1000 // 32 + 1) == (31, 999)  # 31 blocks and 7 of the 8 tail tokens
    assert one.bounds(1000, 29) == (29, 29 * 32)  # a load that came up short caps it: no tail past it
    hybrid = Tails(KVGroups((Group(0, FULL, ("a",)), Group(1, SLIDING, ("b",), 64)), 2), 32)
    assert (hybrid.inside, hybrid.records) == (False, False)
    assert hybrid.bounds(960, 31) == (29, 928)  # block-aligned, before the last prompt token's block
    zeroed = Tails(KVGroups((Group(0, FULL, ("a",)),), 1), 32, SimpleNamespace(needs_kv_cache_zeroing=True))
    assert (zeroed.inside, zeroed.records) == (True, False)
    assert zeroed.bounds(1000, 32) == (31, 992)


def test_an_mla_model_keeps_whole_blocks():
    from types import SimpleNamespace

    from tiered_kv.scheduler.groups import FULL, Group, KVGroups
    from tiered_kv.scheduler.tails import Tails

    mla_spec = type("MLAAttentionSpec", (), {})()  # what vLLM names DeepSeek's latent KV spec
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=mla_spec)])
    mla = Tails(KVGroups((Group(0, FULL, ("a",)),), 1), 32, kcc)
    assert (mla.inside, mla.records) == (False, False)
    assert mla.bounds(960, 31) == (29, 928)
