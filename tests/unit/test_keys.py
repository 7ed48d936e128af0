from __future__ import annotations

import pytest

import tiered_kv as tkv
from tiered_kv.keys import BlockKeyer, KeyNamespace

NS = KeyNamespace("m", "float16", "abcd", 4)


@pytest.mark.parametrize(("name", "length"), [("sha256", 32), ("xxh3_128", 16)])
def test_keys_are_chained_and_fixed_length(name, length):
    keyer = BlockKeyer(NS, name)
    keys = keyer.keys_for_tokens(list(range(10)))  # 2 full blocks, partial tail has no key
    assert len(keys) == 2 and all(len(k) == length for k in keys)
    assert keys[1] == keyer.chain(keys[0], [4, 5, 6, 7])
    # same prefix -> same keys; a change in block 0 changes every later key
    assert keyer.keys_for_tokens(list(range(8)) + [99]) == keys
    changed = keyer.keys_for_tokens([1] + list(range(1, 8)))
    assert changed[0] != keys[0] and changed[1] != keys[1]


@pytest.mark.parametrize(
    "other",
    [
        KeyNamespace("other-model", "float16", "abcd", 4),
        KeyNamespace("m", "bfloat16", "abcd", 4),
        KeyNamespace("m", "float16", "ffff", 4),
        KeyNamespace("m", "float16", "abcd", 4, tenant_salt="tenant-b"),
    ],
)
def test_namespace_separates_keys(other):
    tokens = list(range(8))
    assert BlockKeyer(NS).keys_for_tokens(tokens) != BlockKeyer(other).keys_for_tokens(tokens)


def test_block_ids_and_unknown_hash():
    keyer = BlockKeyer(NS)
    a = keyer.keys_for_block_ids([1, 2, 3])
    assert a[2] == keyer.chain(keyer.chain(keyer.chain(None, [1]), [2]), [3])
    with pytest.raises(tkv.ConfigError, match="keys.hash"):
        BlockKeyer(NS, "md5")
