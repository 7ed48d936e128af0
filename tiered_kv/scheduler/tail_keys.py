"""Keys of partial tails: a prompt's last block when the prompt ends inside it (issue 39 item 2).

A prompt of ``L`` tokens with ``L % block_size = r > 0`` leaves ``r`` tokens in its last block ``K = L //
block_size``. Their KV is stored as a *tail record* under a key that chains over every earlier token (the
key of block ``K - 1``, which carries the request salt and the whole prefix) and the ``r`` tail tokens:

    tail_key = keyer.chain(key of block K - 1, [TAIL_MARK, r, t_0 .. t_{r-1}, 0 .. 0])   # block_size + 2 words

so it matches only a request whose tokens in block ``K`` begin with exactly those ``r`` tokens, after
exactly that prefix. It can never equal a full block's key: a full block's input is ``block_size`` words
(``block_size + 4`` for a salted first block) that begin with a token id (>= 0), a tail's is ``block_size +
2`` words that begin with a negative marker. The parent is the previous block's key, so a prompt shorter
than one block has no tail record (it would save less than one block's compute, and its only parent is
the salt). A tail key is never a parent: nothing chains on from it, so a partial tail never becomes a full
block's key.

``TailIndex`` remembers which tail lengths were stored under each parent key (a bitmask per parent), so a
lookup hashes and looks up only those lengths, longest first, instead of every length. A miss says
nothing about the bit (another request's tail of that length, with other tokens, may still be held), so
bits are never cleared one by one: the index is bounded by its parents (least recently stored first out,
at most ``block_size - 1`` bits each), and a stale bit costs one hash and one lookup. A tail the index
forgot, or one recovered from disk after a restart, is never found: a lost hit, never a wrong one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

from ..keys import BlockKeyer

TAIL_MARK = -0x7461696C6B657931  # "tailkey1", negated: no token id is negative
INDEX_CAP = 1 << 16  # parents remembered (about 150 bytes each: at most ~10 MB)


def tail_key(keyer: BlockKeyer, parent: bytes, tokens: Sequence[int], block_size: int) -> bytes:
    """The key of the partial block whose first ``len(tokens)`` positions hold ``tokens``, after ``parent``
    (the key of the block before it). ``0 < len(tokens) < block_size``."""
    m = len(tokens)
    if not 0 < m < block_size:
        raise ValueError(f"a partial tail has 1..{block_size - 1} tokens, got {m}")
    if not isinstance(parent, bytes) or len(parent) != keyer.key_bytes:
        raise ValueError("a partial tail chains on the key of the block before it")
    words = np.zeros(block_size + 2, dtype="<i8")
    words[0] = TAIL_MARK
    words[1] = m
    words[2 : 2 + m] = np.asarray(tokens, dtype="<i8")
    return keyer.chain(parent, words)


class TailIndex:
    """Parent key -> the tail lengths stored under it (bit ``m`` set: a tail of ``m`` tokens). Bounded."""

    def __init__(self, cap: int = INDEX_CAP) -> None:
        if cap <= 0:
            raise ValueError(f"TailIndex needs room for at least one parent, got {cap}")
        self._cap = cap
        self._masks: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._masks)

    def add(self, parent: bytes, length: int) -> None:
        self._masks[parent] = self._masks.get(parent, 0) | (1 << length)
        self._masks.move_to_end(parent)
        while len(self._masks) > self._cap:
            self._masks.popitem(last=False)

    def lengths(self, parent: bytes, at_most: int) -> Iterator[int]:
        """The lengths stored under ``parent`` that are <= ``at_most``, longest first."""
        mask = self._masks.get(parent, 0) & ((1 << (at_most + 1)) - 1)
        while mask:
            m = mask.bit_length() - 1
            yield m
            mask &= ~(1 << m)

    def clear(self) -> None:
        self._masks.clear()
