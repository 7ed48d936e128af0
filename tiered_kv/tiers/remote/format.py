"""The remote tier's value format and key names: self-describing and verified.

Values are parsed from their fixed header and checked; nothing is ever deserialized as an object.

One Redis string per block: an 80-byte header, then the block's bytes.

    magic "TKVR" | version u16 | key_len u8 | flags u8 | payload_len u64 | payload xxh3-64 u64
    | namespace digest 16 B | block key (32 B, zero padded) | header xxh3-64 u64

The Redis key is ``key_prefix + namespace + ":" + hex(block key)``, so models, layouts, ranks and
tenants (each its own namespace) never meet. The header repeats the full key and a digest of the
namespace, so a value copied or restored under another key, or written by another layout or
model, fails verification instead of being served. Anything that does not verify (short,
truncated, flipped byte, wrong magic or version, another key, another namespace, another length)
is a miss. Headers are built and checked a batch at a time as numpy structured rows.
"""

from __future__ import annotations

import binascii
import hashlib

import numpy as np
import xxhash

from ...formats import REMOTE_FORMAT_VERSION as VERSION
from ...formats import REMOTE_HEADER_SIZE as HEADER_SIZE

MAGIC = b"TKVR"
MAX_KEY_BYTES = 32
HDTYPE = np.dtype(
    [("magic", "S4"), ("version", "<u2"), ("key_len", "u1"), ("flags", "u1"), ("plen", "<u8"),
     ("psum", "<u8"), ("ns", "V16"), ("key", "V32"), ("xxh", "<u8")]
)
_KEY_AT = 40  # byte offset of the key in a header

_xxh = xxhash.xxh3_64_intdigest


def namespace_digest(namespace: str) -> bytes:
    return hashlib.sha256(b"tiered_kv.remote\0" + namespace.encode()).digest()[:16]


def redis_keys(prefix: bytes, keys: np.ndarray) -> list[bytes]:
    """``prefix + hex(key)`` for each row of uint8 [n, key_bytes] (prefix ends with the namespace)."""
    n, kb = keys.shape
    hexed = binascii.hexlify(np.ascontiguousarray(keys).tobytes())
    w = 2 * kb
    return [prefix + hexed[i : i + w] for i in range(0, n * w, w)]


def row_sums(rows: list[memoryview] | list[bytes], start: int = 0) -> np.ndarray:
    """xxh3-64 of each buffer from byte ``start`` (slab rows on put, reply values on get)."""
    if start:
        return np.fromiter((_xxh(memoryview(r)[start:]) for r in rows), dtype=np.uint64, count=len(rows))
    return np.fromiter((_xxh(r) for r in rows), dtype=np.uint64, count=len(rows))


def encode_headers(keys: np.ndarray, ns_digest: bytes, payload_len: int, psums: np.ndarray) -> np.ndarray:
    """Headers of a batch as uint8 [n, HEADER_SIZE] (keys: uint8 [n, key_bytes], key_bytes <= 32)."""
    n, kb = keys.shape
    h = np.zeros(n, HDTYPE)
    h["magic"], h["version"], h["key_len"], h["plen"], h["psum"] = MAGIC, VERSION, kb, payload_len, psums
    rows = h.view(np.uint8).reshape(n, HEADER_SIZE)
    rows[:, 24:40] = np.frombuffer(ns_digest, np.uint8)
    rows[:, _KEY_AT : _KEY_AT + kb] = keys
    h["xxh"] = row_sums([memoryview(r)[: HEADER_SIZE - 8] for r in rows])
    return rows


def check_values(values: list, keys: np.ndarray, ns_digest: bytes, payload_len: int) -> np.ndarray:
    """bool per value: it is bytes of exactly header + payload_len, with an intact header naming this
    namespace, this key and this length, and a payload whose xxh3-64 matches the header's."""
    n, kb = keys.shape
    ok = np.fromiter((isinstance(v, bytes) and len(v) == HEADER_SIZE + payload_len for v in values),
                     dtype=bool, count=n)  # fmt: skip
    idx = np.flatnonzero(ok)
    if not idx.size:
        return ok
    heads = np.frombuffer(b"".join(values[i][:HEADER_SIZE] for i in idx), np.uint8).reshape(-1, HEADER_SIZE)
    h = heads.view(HDTYPE).reshape(-1)
    good = row_sums([memoryview(r)[: HEADER_SIZE - 8] for r in heads]) == h["xxh"]
    good &= (h["magic"] == MAGIC) & (h["version"] == VERSION) & (h["key_len"] == kb) & (h["plen"] == payload_len)
    good &= (heads[:, 24:40] == np.frombuffer(ns_digest, np.uint8)).all(axis=1)
    good &= (heads[:, _KEY_AT : _KEY_AT + kb] == keys[idx]).all(axis=1)
    sel = idx[good]
    if sel.size:  # the payload checksum only for values whose header passed (the costly part)
        good[good] = row_sums([values[i] for i in sel], HEADER_SIZE) == h["psum"][good]
    ok[idx] = good
    return ok
