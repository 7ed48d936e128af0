"""Chained block keys.

The key of block i hashes the key of block i-1 and block i's token ids, so a
key stands for the whole prefix up to and including its block. The first key
also folds in a namespace (model id, dtype, layout digest, block tokens and an
optional tenant salt): two models, layouts or tenants never share a key.

Collision trade-off: ``sha256`` (the default, 32-byte keys) makes a crafted
collision infeasible, which matters when tenants share a cache: a collision
would serve one prompt's KV to another. ``xxh3_128`` (16-byte keys) is several
times faster and its accidental-collision odds are negligible (~2^-64 after
2^32 blocks), but it is not collision resistant against an adversary; use it
only when every tenant is trusted or each has its own salt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import get_args

import numpy as np
import xxhash

from .config import KeyHash
from .errors import ConfigError, KeyFormatError

HASHES: tuple[str, ...] = get_args(KeyHash)


@dataclass(frozen=True)
class KeyNamespace:
    """Everything a block's bytes depend on besides its tokens; folded into the first key.

    ``shard`` names the engine's slice of the KV (e.g. ``tp1of2``): two tensor-
    parallel ranks hold different heads for the same tokens, so their keys differ.
    """

    model_id: str
    dtype: str
    layout_digest: str
    block_tokens: int
    tenant_salt: str = ""
    revision: str = ""
    shard: str = ""

    def seed_bytes(self) -> bytes:
        fields = [self.model_id, self.revision, self.dtype, self.layout_digest, self.block_tokens, self.shard,
                  self.tenant_salt]  # fmt: skip
        return json.dumps(["tiered-kv-keys-v2", *fields]).encode()


class BlockKeyer:
    """Turns token ids (or upstream block ids) into chained fixed-length keys."""

    def __init__(self, namespace: KeyNamespace, hash_name: str = "sha256") -> None:
        if hash_name not in HASHES:
            raise ConfigError(f"keys.hash: unknown hash {hash_name!r}; choose one of {', '.join(HASHES)}")
        self.namespace = namespace
        self.hash_name = hash_name
        self.key_bytes = 32 if hash_name == "sha256" else 16
        self._root = self._digest(namespace.seed_bytes())

    def _digest(self, data: bytes) -> bytes:
        if self.hash_name == "sha256":
            return hashlib.sha256(data).digest()
        return xxhash.xxh3_128_digest(data)

    @property
    def root(self) -> bytes:
        """The parent key of a sequence's first block."""
        return self._root

    def chain(self, parent: bytes | None, block_ids: Sequence[int] | np.ndarray) -> bytes:
        """Key of one block given its parent key (None for the first block)."""
        tokens = np.asarray(block_ids, dtype="<i8").tobytes()
        return self._digest((parent or self._root) + tokens)

    def keys_for_tokens(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Keys of every *full* block of ``token_ids``; a trailing partial block gets none."""
        n = self.namespace.block_tokens
        arr = np.asarray(token_ids, dtype="<i8")
        keys: list[bytes] = []
        for start in range(0, len(arr) - n + 1, n):
            parent = self.chain(parent, arr[start : start + n])
            keys.append(parent)
        return keys

    def keys_for_block_ids(self, block_ids: Iterable[int], parent: bytes | None = None) -> list[bytes]:
        """Keys for a sequence whose blocks are already identified upstream (e.g. Mooncake hash_ids).

        Ids are 64-bit hashes, signed or unsigned (``-1`` and ``2**64 - 1`` are the same hash).
        """
        keys = []
        root, digest = self._root, self._digest
        for block_id in block_ids:
            if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
                raise KeyFormatError(f"upstream block id must be an int, got {type(block_id).__name__} {block_id!r}")
            value = int(block_id)
            if not -(1 << 63) <= value < (1 << 64):
                raise KeyFormatError(f"upstream block id {value} does not fit in 64 bits")
            parent = digest((parent or root) + (value & _U64).to_bytes(8, "little"))
            keys.append(parent)
        return keys

    def check(self, keys: Sequence[bytes], what: str = "keys") -> None:
        """Raise KeyFormatError unless every key is ``bytes`` of this keyer's length."""
        check_keys(keys, self.key_bytes, what)


_U64 = (1 << 64) - 1


def check_keys(keys: Sequence[bytes], key_bytes: int, what: str = "keys") -> None:
    """Raise KeyFormatError unless ``keys`` is a sequence of ``bytes`` of ``key_bytes`` each."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise KeyFormatError(f"{what} must be a sequence of bytes keys, got {type(keys).__name__}")
    if not keys or (set(map(type, keys)) == {bytes} and set(map(len, keys)) == {key_bytes}):
        return  # checked at C speed; the loop below only finds the culprit
    for i, key in enumerate(keys):
        if type(key) is not bytes or len(key) != key_bytes:
            raise KeyFormatError(key_problem(key, key_bytes, f"{what}[{i}]"))


def key_problem(key: object, key_bytes: int, where: str) -> str:
    if not isinstance(key, bytes):
        return f"{where} is a {type(key).__name__}, not bytes: keys come from cache.keyer"
    return f"{where} is {len(key)} bytes, expected {key_bytes}: keys come from cache.keyer (keys.hash)"
